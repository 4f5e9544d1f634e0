//! Where a dispatcher's claims have got to, so that no claim walks again
//! what an earlier one passed.
//!
//! A claim turns a pending row into a processing one. Until vacuum removes
//! it, the pending version stays in the pending indexes, and while a long
//! transaction anywhere in the database holds the xmin horizon back, vacuum
//! removes nothing: a claim that scans from the start of the queue walks
//! every row ever claimed since. So each dispatcher keeps its place.
//!
//! Rows are ordered by `(pending_xid, id)`: the transaction that made the
//! row pending (inserted it, or set it pending again), then the row's id.
//! Transaction ids are handed out in order but commit in any order, which
//! snapshots describe exactly: every transaction below a snapshot's `xmax`
//! and not in its `xip` list had ended when it was taken. So one claim
//! statement scans
//!
//! - **fresh** rows: from the key where this dispatcher got to, on;
//! - rows of the transactions it passed while they were in progress
//!   (**behind**), once each has ended, from where it got to in each;
//! - rows it passed before they were due, once due (**came due**: by
//!   `(available_at, id)` from the time of its last claim on);
//! - and, once per sweep interval, every pending row (a **sweep**: by
//!   `(available_at, id)`, in steps), for rows it could not lock as it
//!   passed them, or that came in with a `pending_xid` of another history (a
//!   restored dump).
//!
//! The four are disjoint, and each has a `LIMIT` of what the ones before it
//! left. A source that returned fewer rows than its limit has been read to
//! its end; one that returned its limit stopped at the last row it
//! returned. [`Frontier::advance`] moves every position accordingly, and
//! only after the claim committed: a claim that failed is scanned again.
//! Everything here is plain arithmetic on what the claim returned; the SQL
//! is `sql/worker/claim.sql`.

use std::collections::BTreeMap;

use uuid::Uuid;

/// A transaction id with its epoch (PostgreSQL's `xid8`).
pub type Xid = u64;

/// A position in `(pending_xid, id)` order.
pub type XidKey = (Xid, Uuid);

/// A position in `(available_at, id)` order; `T` is the time.
pub type DueKey<T> = (T, Uuid);

/// The last id: after `(x, LAST)` comes the first row of transaction x + 1.
const LAST: Uuid = Uuid::from_u128(u128::MAX);

/// The claim statement's snapshot: transactions below `xmax` had ended when
/// it was taken, except those in `xip`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub xmax: Xid,
    pub xip: Vec<Xid>,
}

/// Which scan of the claim found a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The range of [`Bounds::segments`] with this index.
    Segment(usize),
    CameDue,
    Swept,
}

/// One claimed row, as far as positions go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimed<T> {
    pub source: Source,
    pub key: XidKey,
    pub available_at: T,
}

/// A range in `(pending_xid, id)` order: rows after `after` with a
/// `pending_xid` below `before`. With `ended`, only once that transaction
/// has ended (while it runs its rows are invisible, and a scan costs an
/// index descent for nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub after: XidKey,
    pub before: Xid,
    pub ended: Option<Xid>,
}

/// What one claim scans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounds<T> {
    /// Behind transactions in order, then the fresh range.
    pub segments: Vec<Segment>,
    /// Rows the segments have passed: up to this key, and not of `behind`.
    /// `None` before the first claim, which passes nothing.
    pub passed: Option<XidKey>,
    pub behind: Vec<Xid>,
    /// Passed rows that have come due: after this key, up to the claim's now.
    pub came_due_after: Option<DueKey<T>>,
    /// A sweep under way: passed rows after `after` and due by `until`
    /// (`None`: the claim's now).
    pub sweep: Option<SweepBounds<T>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepBounds<T> {
    pub after: Option<DueKey<T>>,
    pub until: Option<T>,
}

/// Where one dispatcher's claims have got to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frontier<T> {
    /// Rows after this key have not been looked at; `None` until the first
    /// claim.
    fresh: Option<XidKey>,
    /// Transactions the fresh range passed while they were in progress, and
    /// where their own rows have got to (`None`: their first row).
    behind: BTreeMap<Xid, Option<Uuid>>,
    /// Passed rows due after this key have not been looked at again.
    came_due: Option<DueKey<T>>,
    sweep: Option<SweepBounds<T>>,
}

impl<T: Copy + Ord> Default for Frontier<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Copy + Ord> Frontier<T> {
    /// Before the first claim, which sweeps everything due.
    pub fn new() -> Self {
        Frontier {
            fresh: None,
            behind: BTreeMap::new(),
            came_due: None,
            sweep: Some(SweepBounds { after: None, until: None }),
        }
    }

    /// Starts a sweep of every pending row passed and due by now, unless
    /// one is under way.
    pub fn start_sweep(&mut self) {
        if self.sweep.is_none() {
            self.sweep = Some(SweepBounds { after: None, until: self.came_due.map(|(at, _)| at) });
        }
    }

    pub fn sweeping(&self) -> bool {
        self.sweep.is_some()
    }

    /// Transactions passed in progress and not yet read.
    pub fn behind(&self) -> usize {
        self.behind.len()
    }

    /// What the next claim scans.
    pub fn bounds(&self) -> Bounds<T> {
        let mut segments: Vec<Segment> = self
            .behind
            .iter()
            .map(|(&xid, after)| Segment {
                after: after.map_or((xid - 1, LAST), |id| (xid, id)),
                before: xid + 1,
                ended: Some(xid),
            })
            .collect();
        if let Some(after) = self.fresh {
            segments.push(Segment { after, before: Xid::MAX, ended: None });
        }
        Bounds {
            segments,
            passed: self.fresh,
            behind: self.behind.keys().copied().collect(),
            came_due_after: self.came_due,
            sweep: self.sweep,
        }
    }

    /// Moves past what a claim of up to `limit` rows with these `bounds`
    /// read, at `now` with `snapshot`, once it has committed.
    pub fn advance(
        &mut self,
        bounds: &Bounds<T>,
        limit: usize,
        snapshot: &Snapshot,
        now: T,
        claimed: &[Claimed<T>],
    ) {
        let in_progress = |xid: &Xid| snapshot.xip.contains(xid);
        // A row updated after the snapshot was taken (made pending again,
        // or moved, by a transaction the snapshot does not see) is returned
        // as it is now, not where the scan found it: its keys say nothing
        // of how far the scan got.
        let scanned = |c: &&Claimed<T>| c.key.0 < snapshot.xmax && !in_progress(&c.key.0);
        let from = |source: Source| claimed.iter().filter(move |c| c.source == source);
        let segmented = claimed.iter().filter(|c| matches!(c.source, Source::Segment(_))).count();
        // The segments are read in order under one LIMIT: all of them to
        // their end, or up to the last row returned.
        let last = claimed
            .iter()
            .filter_map(|c| match c.source {
                Source::Segment(i) => Some(i),
                _ => None,
            })
            .max();
        let reach = |i: usize| match last {
            _ if segmented < limit => Reach::End,
            Some(last) if i < last => Reach::End,
            Some(last) if i == last => claimed
                .iter()
                .filter(|c| c.source == Source::Segment(i))
                .filter(scanned)
                .map(|c| c.key)
                .max()
                .map_or(Reach::Unread, Reach::Key),
            _ => Reach::Unread,
        };
        let xids = bounds.behind.len();
        for (i, xid) in bounds.behind.iter().enumerate() {
            match reach(i) {
                Reach::End if !in_progress(xid) => {
                    self.behind.remove(xid);
                }
                Reach::Key((_, id)) => {
                    self.behind.insert(*xid, Some(id));
                }
                Reach::End | Reach::Unread => {}
            }
        }
        let passed = match (bounds.passed, reach(xids)) {
            (None, _) | (Some(_), Reach::End) => Some((snapshot.xmax - 1, LAST)),
            (Some(_), Reach::Key(key)) => Some(key),
            (Some(_), Reach::Unread) => None,
        };
        if let Some(passed) = passed {
            // What was in progress as the fresh range went by is behind now.
            for &xid in snapshot.xip.iter().filter(|&&xid| xid <= passed.0) {
                self.behind.entry(xid).or_insert(None);
            }
            self.fresh = Some(passed);
        }

        let room = limit.saturating_sub(segmented);
        let came_due = from(Source::CameDue).count();
        if bounds.passed.is_none() || came_due < room {
            self.came_due = Some((now, LAST));
        } else if let Some(key) =
            from(Source::CameDue).filter(scanned).map(|c| (c.available_at, c.key.1)).max()
        {
            self.came_due = Some(key);
        }

        let room = room.saturating_sub(came_due);
        if let Some(sweep) = bounds.sweep {
            let swept = from(Source::Swept).count();
            let until = Some(sweep.until.unwrap_or(now));
            self.sweep = if swept < room {
                None
            } else {
                let after = from(Source::Swept)
                    .filter(scanned)
                    .map(|c| (c.available_at, c.key.1))
                    .max()
                    .or(sweep.after);
                Some(SweepBounds { after, until })
            };
        }
    }
}

/// How far a claim read one segment.
enum Reach {
    End,
    Key(XidKey),
    Unread,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn row(source: Source, xid: Xid, n: u128, at: i64) -> Claimed<i64> {
        Claimed { source, key: (xid, id(n)), available_at: at }
    }

    fn snapshot(xmax: Xid, xip: &[Xid]) -> Snapshot {
        Snapshot { xmax, xip: xip.to_vec() }
    }

    /// A frontier after its first claim at `now` with `snapshot`, which
    /// found nothing.
    fn started(snapshot: &Snapshot, now: i64) -> Frontier<i64> {
        let mut f = Frontier::new();
        let b = f.bounds();
        f.advance(&b, 10, snapshot, now, &[]);
        f
    }

    #[test]
    fn the_first_claim_sweeps_everything_due_and_passes_the_snapshot() {
        let mut f = Frontier::<i64>::new();
        let b = f.bounds();
        assert!(b.segments.is_empty() && b.passed.is_none());
        assert_eq!(b.sweep, Some(SweepBounds { after: None, until: None }));
        f.advance(&b, 10, &snapshot(100, &[90, 95]), 1000, &[row(Source::Swept, 7, 1, 5)]);
        let b = f.bounds();
        // Read to the end: no sweep left; 90 and 95 are behind, fresh from 100.
        assert_eq!(b.sweep, None);
        assert_eq!(b.behind, vec![90, 95]);
        assert_eq!(b.passed, Some((99, LAST)));
        assert_eq!(b.segments.last(), Some(&Segment { after: (99, LAST), before: Xid::MAX, ended: None }));
        assert_eq!(b.segments[0], Segment { after: (89, LAST), before: 91, ended: Some(90) });
        assert_eq!(b.came_due_after, Some((1000, LAST)));
    }

    #[test]
    fn a_sweep_cut_by_the_limit_goes_on_from_its_last_row_until_the_first_now() {
        let mut f = Frontier::<i64>::new();
        let b = f.bounds();
        let rows: Vec<_> = (0..3).map(|n| row(Source::Swept, 7, n, 10 + n as i64)).collect();
        f.advance(&b, 3, &snapshot(100, &[]), 1000, &rows);
        let b = f.bounds();
        assert_eq!(b.sweep, Some(SweepBounds { after: Some((12, id(2))), until: Some(1000) }));
        // Next claim: room is taken by fresh rows; the sweep stays put.
        let rows: Vec<_> = (0..3).map(|n| row(Source::Segment(0), 120, n, 1500)).collect();
        f.advance(&b, 3, &snapshot(130, &[]), 2000, &rows);
        assert_eq!(f.bounds().sweep, Some(SweepBounds { after: Some((12, id(2))), until: Some(1000) }));
    }

    #[test]
    fn a_transaction_in_progress_when_passed_is_read_once_it_has_ended() {
        let mut f = started(&snapshot(100, &[90]), 1000);
        // 90 still runs: its segment is asked only once ended, and kept.
        let b = f.bounds();
        assert_eq!(b.segments.len(), 2);
        f.advance(&b, 10, &snapshot(110, &[90, 105]), 1100, &[row(Source::Segment(1), 101, 1, 1050)]);
        assert_eq!(f.bounds().behind, vec![90, 105]);
        // 90 committed with two rows, 105 still runs.
        let b = f.bounds();
        let rows = [row(Source::Segment(0), 90, 5, 900), row(Source::Segment(0), 90, 6, 900)];
        f.advance(&b, 10, &snapshot(120, &[105]), 1200, &rows);
        assert_eq!(f.bounds().behind, vec![105]);
        assert_eq!(f.bounds().passed, Some((119, LAST)));
    }

    #[test]
    fn a_large_late_transaction_is_read_on_from_its_last_row() {
        let mut f = started(&snapshot(100, &[90]), 1000);
        let b = f.bounds();
        let rows: Vec<_> = (0..3).map(|n| row(Source::Segment(0), 90, n, 900)).collect();
        f.advance(&b, 3, &snapshot(130, &[]), 1100, &rows);
        let b = f.bounds();
        assert_eq!(b.segments[0], Segment { after: (90, id(2)), before: 91, ended: Some(90) });
        // The fresh range was not read: it stays where it was.
        assert_eq!(b.passed, Some((99, LAST)));
        // The came-due scan had no room: it stays too.
        assert_eq!(b.came_due_after, Some((1000, LAST)));
        f.advance(&b, 3, &snapshot(130, &[]), 1200, &[row(Source::Segment(0), 90, 3, 900)]);
        assert_eq!(f.bounds().behind, Vec::<Xid>::new());
        assert_eq!(f.bounds().passed, Some((129, LAST)));
    }

    #[test]
    fn a_fresh_range_cut_by_the_limit_keeps_what_it_passed_in_progress() {
        let mut f = started(&snapshot(100, &[]), 1000);
        let b = f.bounds();
        // 104 ran while rows of 103 and 107 were read; 110 is beyond the cut.
        let rows = [row(Source::Segment(0), 103, 1, 1000), row(Source::Segment(0), 107, 1, 1000)];
        f.advance(&b, 2, &snapshot(120, &[104, 110]), 1100, &rows);
        let b = f.bounds();
        assert_eq!(b.passed, Some((107, id(1))));
        assert_eq!(b.behind, vec![104]);
    }

    #[test]
    fn rows_came_due_are_read_from_the_last_claim_on() {
        let mut f = started(&snapshot(100, &[]), 1000);
        let b = f.bounds();
        let rows = [row(Source::CameDue, 50, 1, 1010), row(Source::CameDue, 60, 2, 1020)];
        f.advance(&b, 5, &snapshot(100, &[]), 1100, &rows);
        assert_eq!(f.bounds().came_due_after, Some((1100, LAST)));
        let b = f.bounds();
        let rows = [row(Source::Segment(0), 101, 1, 1100), row(Source::CameDue, 50, 3, 1030)];
        f.advance(&b, 2, &snapshot(110, &[]), 1200, &rows);
        assert_eq!(f.bounds().came_due_after, Some((1030, id(3))));
    }

    #[test]
    fn a_sweep_starts_from_the_beginning_until_the_came_due_scan() {
        let mut f = started(&snapshot(100, &[]), 1000);
        assert!(!f.sweeping());
        f.start_sweep();
        assert_eq!(f.bounds().sweep, Some(SweepBounds { after: None, until: Some(1000) }));
        let b = f.bounds();
        f.advance(&b, 10, &snapshot(100, &[]), 1100, &[row(Source::Swept, 5, 1, 10)]);
        assert!(!f.sweeping());
    }

    #[test]
    fn a_row_updated_after_the_snapshot_does_not_move_a_position() {
        let mut f = started(&snapshot(100, &[]), 1000);
        let b = f.bounds();
        // The scan locked (101, 1) and a row it found at (102, 5), which a
        // transaction the snapshot does not see (150) has set pending again
        // since: it comes back with its new key, far beyond the scan.
        let rows = [row(Source::Segment(0), 101, 1, 1000), row(Source::Segment(0), 150, 5, 1000)];
        f.advance(&b, 2, &snapshot(140, &[]), 1100, &rows);
        assert_eq!(f.bounds().passed, Some((101, id(1))));
        // Only such rows: the position stays where it was.
        let b = f.bounds();
        f.advance(&b, 1, &snapshot(140, &[]), 1200, &[row(Source::Segment(0), 150, 6, 1000)]);
        assert_eq!(f.bounds().passed, Some((101, id(1))));
    }
}
