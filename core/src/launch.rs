//! What the launcher does on each turn, as plain arithmetic: from the
//! databases that exist, the value of `outbox.database`, and what it knows
//! of each (no extension there; held by a command that needs it alone),
//! which databases get a group of dispatchers and which groups are let go.
//! The launcher (src/launcher.rs) carries it out: assigns groups in shared
//! memory, starts and stops the dispatchers.

use crate::databases::Served;

/// One row of `pg_database`, as far as serving it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Database {
    pub oid: u32,
    pub name: String,
    pub allows_connections: bool,
    pub is_template: bool,
}

/// What the launcher knows of a database beyond `pg_database`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known {
    /// Its probe found no extension (until a `CREATE EXTENSION` anywhere
    /// says to look again).
    Absent,
    /// A command that needs it alone (`DROP DATABASE`, a rename, a copy)
    /// holds it.
    Held,
}

/// The launcher's turn.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Turn {
    /// Databases to give a free group: (group, database OID).
    pub assign: Vec<(usize, u32)>,
    /// Groups to stop and free: their database is no longer to be served.
    pub release: Vec<usize>,
    /// Databases to serve for which no group is free.
    pub unplaced: Vec<u32>,
}

/// Plans a turn. `groups[g]` is the database group g serves (`None`:
/// free); `known(oid)` what the launcher knows of a database.
pub fn turn(
    served: &Served,
    databases: &[Database],
    groups: &[Option<u32>],
    known: impl Fn(u32) -> Option<Known>,
) -> Turn {
    let wanted: Vec<u32> = databases
        .iter()
        .filter(|d| {
            d.allows_connections && !d.is_template && served.covers(&d.name) && known(d.oid).is_none()
        })
        .map(|d| d.oid)
        .collect();
    let mut turn = Turn::default();
    let mut free = Vec::new();
    for (g, database) in groups.iter().enumerate() {
        match database {
            Some(oid) if !wanted.contains(oid) => turn.release.push(g),
            Some(_) => {}
            None => free.push(g),
        }
    }
    let mut free = free.into_iter();
    for oid in wanted.into_iter().filter(|oid| !groups.contains(&Some(*oid))) {
        match free.next() {
            Some(g) => turn.assign.push((g, oid)),
            None => turn.unplaced.push(oid),
        }
    }
    turn
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db(oid: u32, name: &str) -> Database {
        Database { oid, name: name.into(), allows_connections: true, is_template: false }
    }

    fn all() -> Served {
        Served::parse("*").unwrap()
    }

    #[test]
    fn every_database_that_allows_connections_and_is_no_template_is_served_under_a_star() {
        let mut template = db(1, "template1");
        template.is_template = true;
        let mut closed = db(2, "closed");
        closed.allows_connections = false;
        let databases = [template, closed, db(5, "postgres"), db(16384, "app")];
        let t = turn(&all(), &databases, &[None, None, None], |_| None);
        assert_eq!(t, Turn { assign: vec![(0, 5), (1, 16384)], ..Turn::default() });
    }

    #[test]
    fn a_list_names_what_is_served_and_the_rest_is_let_go() {
        let databases = [db(5, "postgres"), db(16384, "app"), db(16385, "billing")];
        let served = Served::parse("app, billing").unwrap();
        let t = turn(&served, &databases, &[Some(5), Some(16384), None], |_| None);
        assert_eq!(t, Turn { assign: vec![(2, 16385)], release: vec![0], ..Turn::default() });
    }

    #[test]
    fn a_database_without_the_extension_or_held_is_not_served_and_a_dropped_one_is_let_go() {
        let databases = [db(16384, "app"), db(16385, "billing")];
        let known = |oid| match oid {
            16384 => Some(Known::Absent),
            16385 => Some(Known::Held),
            _ => None,
        };
        // 16386 was dropped: no longer in pg_database.
        let t = turn(&all(), &databases, &[Some(16385), Some(16386)], known);
        assert_eq!(t, Turn { release: vec![0, 1], ..Turn::default() });
    }

    #[test]
    fn databases_beyond_the_groups_are_named() {
        let databases = [db(5, "postgres"), db(16384, "app"), db(16385, "billing")];
        let t = turn(&all(), &databases, &[Some(5)], |_| None);
        assert_eq!(t, Turn { unplaced: vec![16384, 16385], ..Turn::default() });
    }
}
