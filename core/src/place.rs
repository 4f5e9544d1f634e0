//! An event's place in line, `(pending_xid, id)`, against the page of a
//! window a batch read (sql/schema.sql, `outbox.held_by()`): what the view
//! `outbox.events` asks of every row it reads in line, which the library
//! answers from the last page it found (src/state.rs) rather than with an
//! index probe per row.

use std::cmp::Ordering;

/// A place in line: the transaction that put the event there
/// (`pending_xid`, an `xid8`) and its id (`uuid`, compared as PostgreSQL
/// compares them: byte by byte).
pub type Place = (u64, [u8; 16]);

/// A `pg_snapshot`: which transactions it sees as ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    xmin: u64,
    xmax: u64,
    /// In progress when it was taken, in order.
    xip: Vec<u64>,
}

impl Snapshot {
    /// A snapshot as PostgreSQL writes it (`xmin:xmax:xip,xip`).
    pub fn parse(text: &str) -> Option<Snapshot> {
        let mut parts = text.splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let list = parts.next()?;
        let mut xip = if list.is_empty() {
            Vec::new()
        } else {
            list.split(',').map(str::parse).collect::<Result<Vec<u64>, _>>().ok()?
        };
        xip.sort_unstable();
        Some(Snapshot { xmin, xmax, xip })
    }

    /// Whether it sees transaction `xid` as ended, as
    /// `pg_visible_in_snapshot()` says.
    pub fn sees(&self, xid: u64) -> bool {
        xid < self.xmin || (xid < self.xmax && self.xip.binary_search(&xid).is_err())
    }
}

/// The page of a window one batch read: the places after `from` (from the
/// window's start without it) up to `to`, of the transactions `target`
/// sees ended and `prev` did not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub from: Option<Place>,
    pub to: Place,
    pub prev: Snapshot,
    pub target: Snapshot,
}

impl Page {
    /// Whether `place` lies in this page.
    pub fn holds(&self, place: &Place) -> bool {
        place.cmp(&self.to) != Ordering::Greater
            && self.from.is_none_or(|from| from < *place)
            && self.target.sees(place.0)
            && !self.prev.sees(place.0)
    }
}

/// Where the claims have read up to (`outbox.cursor`): every place of a
/// transaction `prev` sees ended, and in the window being read (the
/// transactions `target` sees ended) the places up to `after`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub prev: Snapshot,
    pub target: Option<Snapshot>,
    pub after: Option<Place>,
}

impl Cursor {
    /// Whether a claim has read `place` (the complement of the view
    /// `outbox.unread`).
    pub fn read(&self, place: &Place) -> bool {
        self.prev.sees(place.0)
            || (self.target.as_ref().is_some_and(|target| target.sees(place.0))
                && self.after.is_some_and(|after| *place <= after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(last: u8) -> [u8; 16] {
        let mut id = [0; 16];
        id[15] = last;
        id
    }

    #[test]
    fn a_snapshot_sees_what_pg_visible_in_snapshot_sees() {
        let s = Snapshot::parse("100:110:107,103").unwrap();
        assert!(s.sees(99) && s.sees(100) && s.sees(104) && s.sees(109));
        assert!(!s.sees(103) && !s.sees(107) && !s.sees(110) && !s.sees(200));
        let empty = Snapshot::parse("5:5:").unwrap();
        assert!(empty.sees(4) && !empty.sees(5));
        for bad in ["", "1", "1:2", "a:2:", "1:2:x", "1:2:3,"] {
            assert_eq!(Snapshot::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_page_holds_the_places_between_its_positions_of_its_window() {
        let page = Page {
            from: Some((101, id(5))),
            to: (104, id(2)),
            prev: Snapshot::parse("101:102:").unwrap(),
            target: Snapshot::parse("103:106:104").unwrap(),
        };
        // The window: 101 is not in it (prev saw it ended), 102 and 103 are,
        // 104 is not (target saw it in progress), 105 is.
        assert!(!page.holds(&(101, id(9))), "prev saw it ended");
        assert!(page.holds(&(102, id(0))) && page.holds(&(103, id(255))));
        assert!(!page.holds(&(104, id(1))), "target saw it in progress");
        assert!(!page.holds(&(105, id(0))), "after the page's last place");
        let first = Page { from: None, ..page.clone() };
        assert!(first.holds(&(102, id(0))));
        let after = Page { from: Some((102, id(7))), ..page };
        assert!(!after.holds(&(102, id(7))) && after.holds(&(102, id(8))));
    }

    #[test]
    fn a_cursor_has_read_what_its_prev_saw_and_its_window_up_to_its_position() {
        let prev = Snapshot::parse("100:103:101").unwrap();
        let idle = Cursor { prev: prev.clone(), target: None, after: None };
        assert!(idle.read(&(99, id(0))) && idle.read(&(102, id(0))));
        assert!(!idle.read(&(101, id(0))) && !idle.read(&(103, id(0))));
        let reading = Cursor {
            prev: prev.clone(),
            target: Some(Snapshot::parse("104:106:105").unwrap()),
            after: Some((103, id(5))),
        };
        // 101 (behind, ended since) and 103 up to the position: read.
        assert!(reading.read(&(101, id(255))) && reading.read(&(103, id(5))));
        assert!(!reading.read(&(103, id(6))), "after the position");
        assert!(!reading.read(&(104, id(0))), "beyond the position");
        assert!(!reading.read(&(105, id(0))), "in progress for the target");
        let begun = Cursor { prev, target: Some(Snapshot::parse("104:104:").unwrap()), after: None };
        assert!(!begun.read(&(101, id(0))) && begun.read(&(100, id(0))));
    }
}
