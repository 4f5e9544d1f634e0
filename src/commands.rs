//! The commands of other sessions the dispatchers must make way for or
//! hear of, seen by a `ProcessUtility_hook` in every backend (the library
//! is preloaded).
//!
//! Commands that need a database to themselves: `DROP DATABASE`, `ALTER
//! DATABASE … RENAME` and `… SET TABLESPACE`, `CREATE DATABASE … TEMPLATE`.
//! Each fails while another session is connected to the database, and a
//! dispatcher is one. When PostgreSQL would run the command for the user
//! (the hook makes its checks first), the hook holds the database — the
//! launcher starts no dispatcher there, and one that connects leaves at
//! once — stops the dispatchers connected to it and waits until they are
//! gone, [`WAIT`] at most, then runs the command. The hold ends with the
//! command, whether it succeeded or failed; the launcher then serves the
//! database again if it is still to be served.
//!
//! `DROP EXTENSION` wakes this database's dispatchers as it commits: they
//! find the extension gone and exit. (`DROP SCHEMA … CASCADE` and `DROP
//! OWNED` can drop it too, unseen: the dispatchers find out at their next
//! wake, `outbox.poll_interval` at the latest.)

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::ffi::{c_char, CStr};
use std::time::{Duration, Instant};

use pgrx::prelude::*;
use pgrx::PgList;

mod catalog;

use crate::slots::{self, Holding, NotHeld, WakeSource};
use crate::wake;

/// The longest a command waits for the dispatchers to leave; PostgreSQL
/// then waits 5 s more for any session before it gives up.
const WAIT: Duration = Duration::from_secs(5);

static mut PREVIOUS: pg_sys::ProcessUtility_hook_type = None;

/// Installs the hook; `_PG_init` calls this while preloading.
pub fn install() {
    // SAFETY: called once, in the postmaster, before any backend runs.
    unsafe {
        PREVIOUS = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(process_utility);
    }
}

unsafe extern "C-unwind" {
    /// tcop/utility.h, called without pgrx's guard (see [`process_utility`]).
    #[link_name = "standard_ProcessUtility"]
    fn standard_process_utility(
        pstmt: *mut pg_sys::PlannedStmt,
        query_string: *const c_char,
        read_only_tree: bool,
        context: pg_sys::ProcessUtilityContext::Type,
        params: pg_sys::ParamListInfo,
        query_env: *mut pg_sys::QueryEnvironment,
        dest: *mut pg_sys::DestReceiver,
        qc: *mut pg_sys::QueryCompletion,
    );
}

/// The hook. Not guarded by pgrx, and the command is not called through
/// pgrx's guard either: an ERROR the command raises must reach PostgreSQL's
/// handler as it was raised, with its position, context and fields, not
/// turned into a Rust panic and back (which keeps only the message, detail
/// and hint). Nothing in this frame has a destructor; the Rust work runs
/// in the guarded [`before`] and [`after`] (which must not read the
/// statement: the command may have freed it), and a hold ends with the
/// (sub)transaction that took it ([`on_xact_event`], [`on_subxact_event`]).
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn process_utility(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    query_env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    let seen = before((*pstmt).utilityStmt, context);
    match PREVIOUS {
        Some(previous) => previous(pstmt, query_string, read_only_tree, context, params, query_env, dest, qc),
        None => standard_process_utility(
            pstmt,
            query_string,
            read_only_tree,
            context,
            params,
            query_env,
            dest,
            qc,
        ),
    }
    after(seen);
}

thread_local! {
    /// The databases this backend holds, each with the subtransaction that
    /// took it: until the rename that took it ends, or its transaction (or,
    /// when it fails, its subtransaction).
    static HOLDING: RefCell<Vec<(pg_sys::SubTransactionId, Holding)>> = const { RefCell::new(Vec::new()) };
    static CALLBACKS_REGISTERED: Cell<bool> = const { Cell::new(false) };
}

/// What [`before`] saw of the command, for [`after`].
#[repr(C)]
struct Seen {
    drops_this_extension: bool,
    /// It holds a database until it ends (a rename, which may run in a
    /// transaction block).
    holds_to_its_end: bool,
}

/// Before the command: holds the database it needs alone, if any, and
/// makes way.
#[pg_guard]
unsafe extern "C-unwind" fn before(
    statement: *mut pg_sys::Node,
    context: pg_sys::ProcessUtilityContext::Type,
) -> Seen {
    let mut seen = Seen { drops_this_extension: drops_this_extension(statement), holds_to_its_end: false };
    let Some(database) = needed_alone(statement, context) else {
        return seen;
    };
    let Some(holding) = clear(database) else {
        return seen;
    };
    if !CALLBACKS_REGISTERED.replace(true) {
        // SAFETY: registered once per backend, for its life.
        pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact_event), std::ptr::null_mut());
    }
    let subtransaction = pg_sys::GetCurrentSubTransactionId();
    HOLDING.with_borrow_mut(|holds| holds.push((subtransaction, holding)));
    seen.holds_to_its_end = (*statement).type_ == pg_sys::NodeTag::T_RenameStmt;
    seen
}

/// After the command (not after an error: the end of the (sub)transaction
/// frees a hold then). A rename's hold ends with it: what a rename in a
/// transaction block still needs, its lock on the database keeps (a
/// dispatcher connecting waits for the block to end), so no hold outlives
/// the command that needs it. The others run in a transaction of their
/// own, which ends right after them (the hold keeps the launcher from
/// starting dispatchers for a database being dropped until it is gone).
#[pg_guard]
unsafe extern "C-unwind" fn after(seen: Seen) {
    if seen.holds_to_its_end {
        HOLDING.with_borrow_mut(|holds| holds.pop());
    }
    if seen.drops_this_extension {
        // Manual: paused dispatchers answer it too.
        wake::at_commit(WakeSource::Manual);
    }
}

/// Frees the holds as the transaction ends, committed or not: a `DROP
/// DATABASE` has done its work by then. A backend that exits aborts its
/// transaction first, which lands here too.
#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    use pg_sys::XactEvent::*;
    if matches!(
        event,
        XACT_EVENT_COMMIT
            | XACT_EVENT_PARALLEL_COMMIT
            | XACT_EVENT_ABORT
            | XACT_EVENT_PARALLEL_ABORT
            | XACT_EVENT_PREPARE
    ) {
        HOLDING.with_borrow_mut(Vec::clear);
    }
}

/// A subtransaction rolled back (`ROLLBACK TO SAVEPOINT`, an exception
/// block) frees what it held; one committed hands it to its parent.
#[pg_guard]
unsafe extern "C-unwind" fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    subtransaction: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    HOLDING.with_borrow_mut(|held| match event {
        SUBXACT_EVENT_ABORT_SUB => held.retain(|(sub, _)| *sub != subtransaction),
        SUBXACT_EVENT_COMMIT_SUB => {
            for (sub, _) in held.iter_mut().filter(|(sub, _)| *sub == subtransaction) {
                *sub = parent;
            }
        }
        _ => {}
    });
}

/// Is `statement` a `DROP EXTENSION` naming this extension?
unsafe fn drops_this_extension(statement: *mut pg_sys::Node) -> bool {
    if statement.is_null() || (*statement).type_ != pg_sys::NodeTag::T_DropStmt {
        return false;
    }
    let drop = statement.cast::<pg_sys::DropStmt>();
    (*drop).removeType == pg_sys::ObjectType::OBJECT_EXTENSION
        && PgList::<pg_sys::Node>::from_pg((*drop).objects).iter_ptr().any(|name| {
            !name.is_null()
                && (*name).type_ == pg_sys::NodeTag::T_String
                && !(*name.cast::<pg_sys::String>()).sval.is_null()
                && std::ffi::CStr::from_ptr((*name.cast::<pg_sys::String>()).sval) == c"outbox_dispatch"
        })
}

/// A command that needs a database alone.
enum Command {
    Drop,
    Rename { to: *const c_char },
    MoveTo { tablespace: *const c_char },
    CopyTo { name: *const c_char, options: CopyOptions },
}

/// What the hook checks of a copy's options.
#[derive(Default)]
struct CopyOptions {
    tablespace: Option<*const c_char>,
    owner: Option<*const c_char>,
}

/// The options of `CREATE DATABASE … TEMPLATE` the hook checks as
/// PostgreSQL does. A copy with any other (an encoding, a locale, a
/// collation, an OID: each must match the template's anyway) is left to
/// PostgreSQL, as is one with an option given twice.
const COPY_OPTIONS: [&CStr; 7] = [
    c"template",
    c"owner",
    c"tablespace",
    c"connection_limit",
    c"is_template",
    c"allow_connections",
    c"strategy",
];

/// The database `statement` needs alone, when PostgreSQL would run it here
/// and let the current user run it: each check PostgreSQL makes before it
/// looks for other sessions is made first ([`permitted`], and the options'
/// own checks, which raise PostgreSQL's error here before anything is
/// done). Others are left to PostgreSQL's own refusal: a user who may not
/// run the command must not stop the database's dispatchers by trying.
unsafe fn needed_alone(
    statement: *mut pg_sys::Node,
    context: pg_sys::ProcessUtilityContext::Type,
) -> Option<pg_sys::Oid> {
    if statement.is_null() {
        return None;
    }
    // All but a rename refuse to run in a transaction block, or anywhere
    // but at the top level (a function's EXECUTE).
    let alone =
        context == pg_sys::ProcessUtilityContext::PROCESS_UTILITY_TOPLEVEL && !pg_sys::IsTransactionBlock();
    let (name, command): (*mut c_char, Command) = match (*statement).type_ {
        pg_sys::NodeTag::T_DropdbStmt if alone => {
            ((*statement.cast::<pg_sys::DropdbStmt>()).dbname, Command::Drop)
        }
        pg_sys::NodeTag::T_RenameStmt => {
            let rename = statement.cast::<pg_sys::RenameStmt>();
            if (*rename).renameType != pg_sys::ObjectType::OBJECT_DATABASE {
                return None;
            }
            ((*rename).subname, Command::Rename { to: (*rename).newname })
        }
        pg_sys::NodeTag::T_AlterDatabaseStmt if alone => {
            let alter = statement.cast::<pg_sys::AlterDatabaseStmt>();
            // A tablespace goes alone: with other options, it is refused.
            let [tablespace] = options((*alter).options)[..] else {
                return None;
            };
            if CStr::from_ptr((*tablespace).defname) != c"tablespace" {
                return None;
            }
            ((*alter).dbname, Command::MoveTo { tablespace: pg_sys::defGetString(tablespace) })
        }
        pg_sys::NodeTag::T_CreatedbStmt if alone => {
            let create = statement.cast::<pg_sys::CreatedbStmt>();
            let (template, options) = copy_options((*create).options)?;
            (template, Command::CopyTo { name: (*create).dbname, options })
        }
        _ => return None,
    };
    if name.is_null() {
        return None;
    }
    let database = pg_sys::get_database_oid(name, true);
    (database != pg_sys::InvalidOid && permitted(database, &command)).then_some(database)
}

/// The template a `CREATE DATABASE` copies, and its options, when the
/// hook can check them all ([`COPY_OPTIONS`]); each checked as
/// `createdb` does, its error raised here.
unsafe fn copy_options(list: *mut pg_sys::List) -> Option<(*mut c_char, CopyOptions)> {
    let given = options(list);
    let names: Vec<&CStr> = given.iter().map(|d| CStr::from_ptr((**d).defname)).collect();
    let known = names.iter().all(|n| COPY_OPTIONS.contains(n));
    let once = names.iter().enumerate().all(|(i, n)| !names[..i].contains(n));
    if !known || !once {
        return None;
    }
    let mut template = None;
    let mut checked = CopyOptions::default();
    for &option in &given {
        // An option without a value is DEFAULT: PostgreSQL's own.
        if (*option).arg.is_null() {
            continue;
        }
        match CStr::from_ptr((*option).defname).to_bytes() {
            b"template" => template = Some(pg_sys::defGetString(option)),
            b"owner" => checked.owner = Some(pg_sys::defGetString(option).cast_const()),
            b"tablespace" => checked.tablespace = Some(pg_sys::defGetString(option).cast_const()),
            b"connection_limit" => {
                if pg_sys::defGetInt32(option) < -1 {
                    return None;
                }
            }
            b"strategy" => {
                let strategy = CStr::from_ptr(pg_sys::defGetString(option));
                if !["wal_log", "file_copy"]
                    .iter()
                    .any(|s| strategy.to_bytes().eq_ignore_ascii_case(s.as_bytes()))
                {
                    return None;
                }
            }
            _ => {
                pg_sys::defGetBoolean(option);
            }
        }
    }
    // TEMPLATE DEFAULT, or none: template1, never served.
    Some((template?, checked))
}

/// Would PostgreSQL let the current user run `command` on `database`, as
/// far as the checks it makes before it looks for other sessions go
/// (commands/dbcommands.c: `dropdb`, `RenameDatabase`, `movedb`,
/// `createdb`)?
unsafe fn permitted(database: pg_sys::Oid, command: &Command) -> bool {
    let Some(info) = catalog::database(database) else {
        return false;
    };
    let elsewhere = database != pg_sys::MyDatabaseId;
    let name_free =
        |name: *const c_char| !name.is_null() && pg_sys::get_database_oid(name, true) == pg_sys::InvalidOid;
    let may_create_in = |tablespace: *const c_char| {
        let target = pg_sys::get_tablespace_oid(tablespace, true);
        (target != pg_sys::InvalidOid && catalog::may_create_in(target)).then_some(target)
    };
    match command {
        Command::Drop => {
            elsewhere && catalog::owns(database) && !info.is_template && !catalog::replicated_from(database)
        }
        Command::Rename { to } => {
            elsewhere && catalog::owns(database) && catalog::may_create_databases() && name_free(*to)
        }
        Command::MoveTo { tablespace } => {
            elsewhere
                && catalog::owns(database)
                && may_create_in(*tablespace)
                    .is_some_and(|target| target != info.tablespace && target != pg_sys::GLOBALTABLESPACE_OID)
        }
        Command::CopyTo { name, options } => {
            catalog::may_create_databases()
                && (info.is_template || catalog::owns(database))
                && name_free(*name)
                && options.tablespace.is_none_or(|t| may_create_in(t).is_some())
                && options.owner.is_none_or(|owner| {
                    let role = pg_sys::get_role_oid(owner, true);
                    role != pg_sys::InvalidOid && catalog::may_act_as(role)
                })
        }
    }
}

/// A statement's list of `DefElem`s.
unsafe fn options(list: *mut pg_sys::List) -> Vec<*mut pg_sys::DefElem> {
    PgList::<pg_sys::DefElem>::from_pg(list).iter_ptr().filter(|d| !(**d).defname.is_null()).collect()
}

/// Holds `database`, then stops its dispatchers and waits for them to
/// exit, [`WAIT`] at most (the command then says who is still there).
fn clear(database: pg_sys::Oid) -> Option<Holding> {
    let holding = match slots::hold(database) {
        Ok(holding) => Some(holding),
        Err(NotHeld::NotPreloaded) => None,
        Err(why) => {
            notice!(
                "outbox_dispatch: the database's dispatchers are stopped for this command, \
                 but it is not held against their return: {why}"
            );
            None
        }
    };
    let deadline = Instant::now() + WAIT;
    let mut signalled = HashSet::new();
    loop {
        let running = slots::running_in(database);
        if running.is_empty() || Instant::now() >= deadline {
            break;
        }
        for pid in running.into_iter().filter(|pid| signalled.insert(*pid)) {
            // SAFETY: SIGTERM to a dispatcher of this server, which ends it
            // as a shutdown would.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        // SAFETY: a short wait on this backend's own latch.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                10,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        check_for_interrupts!();
    }
    holding
}
