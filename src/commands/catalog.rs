//! What the catalog says of a database, the current role and a tablespace,
//! for the checks PostgreSQL makes before a command that needs a database
//! alone; read through the system caches, as commands/dbcommands.c does.

use pgrx::prelude::*;

/// A database, as far as those checks go.
pub struct Database {
    pub is_template: bool,
    pub tablespace: pg_sys::Oid,
}

/// `database`'s row of `pg_database`; `None` if it is gone.
///
/// # Safety
/// In a transaction.
pub unsafe fn database(database: pg_sys::Oid) -> Option<Database> {
    let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::DATABASEOID as _, database.into());
    if tuple.is_null() {
        return None;
    }
    let row = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
    let found = Database { is_template: (*row).datistemplate, tablespace: (*row).dattablespace };
    pg_sys::ReleaseSysCache(tuple);
    Some(found)
}

/// May the current role create databases (a superuser, or CREATEDB)? As
/// dbcommands.c's `have_createdb_privilege`, which is not exported.
///
/// # Safety
/// In a transaction.
pub unsafe fn may_create_databases() -> bool {
    if pg_sys::superuser() {
        return true;
    }
    let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::AUTHOID as _, pg_sys::GetUserId().into());
    if tuple.is_null() {
        return false;
    }
    let createdb = (*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_authid>(tuple)).rolcreatedb;
    pg_sys::ReleaseSysCache(tuple);
    createdb
}

/// Does the current role own `database` (or is it a superuser)?
///
/// # Safety
/// In a transaction.
#[cfg(feature = "pg15")]
pub unsafe fn owns(database: pg_sys::Oid) -> bool {
    pg_sys::pg_database_ownercheck(database, pg_sys::GetUserId())
}

#[cfg(not(feature = "pg15"))]
pub unsafe fn owns(database: pg_sys::Oid) -> bool {
    pg_sys::object_ownercheck(pg_sys::DatabaseRelationId, database, pg_sys::GetUserId())
}

/// May the current role create objects in `tablespace`?
///
/// # Safety
/// In a transaction.
#[cfg(feature = "pg15")]
pub unsafe fn may_create_in(tablespace: pg_sys::Oid) -> bool {
    pg_sys::pg_tablespace_aclcheck(tablespace, pg_sys::GetUserId(), pg_sys::ACL_CREATE as _)
        == pg_sys::AclResult::ACLCHECK_OK
}

#[cfg(not(feature = "pg15"))]
pub unsafe fn may_create_in(tablespace: pg_sys::Oid) -> bool {
    pg_sys::object_aclcheck(
        pg_sys::TableSpaceRelationId,
        tablespace,
        pg_sys::GetUserId(),
        pg_sys::ACL_CREATE as _,
    ) == pg_sys::AclResult::ACLCHECK_OK
}

/// May the current role make `role` the owner of what it creates (be a
/// member of it, as `createdb` checks for `OWNER`)?
///
/// # Safety
/// In a transaction.
#[cfg(feature = "pg15")]
pub unsafe fn may_act_as(role: pg_sys::Oid) -> bool {
    pg_sys::is_member_of_role(pg_sys::GetUserId(), role)
}

#[cfg(not(feature = "pg15"))]
pub unsafe fn may_act_as(role: pg_sys::Oid) -> bool {
    pg_sys::member_can_set_role(pg_sys::GetUserId(), role)
}

unsafe extern "C-unwind" {
    /// catalog/pg_subscription.h (not in pgrx's bindings).
    fn CountDBSubscriptions(database: pg_sys::Oid) -> std::ffi::c_int;
}

/// Is `database` the source of logical replication that `DROP DATABASE`
/// refuses to drop: a subscription defined in it, or a logical slot of it
/// in use?
///
/// # Safety
/// In a transaction.
pub unsafe fn replicated_from(database: pg_sys::Oid) -> bool {
    let (mut slots, mut active) = (0, 0);
    CountDBSubscriptions(database) > 0
        || (pg_sys::ReplicationSlotsCountDBSlots(database, &mut slots, &mut active) && active > 0)
}
