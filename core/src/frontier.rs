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
//! and not in its `xip` list had ended when it was taken. One claim
//! statement reads, in this order:
//!
//! - rows passed before they were due, once due (**came due**: by
//!   `(available_at, id)`, from the time of the last claim on);
//! - rows of the transactions the fresh range passed while they were in
//!   progress (**behind**), once each has ended, from where it got to in
//!   each;
//! - **fresh** rows, from where the dispatcher got to on.
//!
//! Once per sweep interval a **sweep** reads the rows it passed again, from
//! the start, in claims of their own (when a claim finds nothing, and now
//! and then under load): rows another session held locked as the claim
//! went by (`SKIP LOCKED` skips them), or that came in with a `pending_xid`
//! of another history (triggers disabled).
//!
//! Each scan has a `LIMIT` of what the ones before it left, and they are
//! disjoint. A scan that returned fewer rows than its limit has been read
//! to its end; one that returned its limit stopped at the last row it
//! returned. No scan reads an unbounded stretch of entries, dead ones
//! included (after a restart, after a pause, in a sweep, under a pinned
//! xmin): the fresh range and the sweep read at most a window of
//! transaction ids per claim, the came-due scan a window of time. Each
//! window widens while it is what stops its scan and claims are quick, and
//! narrows when a claim is slow or fails. (The entries of one transaction
//! are not split: a sweep step walks those of the largest transaction that
//! made rows pending.)
//! [`Frontier::advance`] moves every position accordingly, and only after
//! the claim committed: a claim that failed is read again. Everything here
//! is arithmetic on what the claim returned; the SQL is
//! `sql/worker/claim.sql`.

use std::collections::BTreeMap;
use std::time::Duration;

use uuid::Uuid;

/// A transaction id with its epoch (PostgreSQL's `xid8`).
pub type Xid = u64;

/// A time as PostgreSQL stores `timestamptz`: microseconds since 2000.
pub type Micros = i64;

/// A position in `(pending_xid, id)` order.
pub type XidKey = (Xid, Uuid);

/// A position in `(available_at, id)` order.
pub type DueKey = (Micros, Uuid);

/// The last id: after `(x, LAST)` comes the first row of transaction x + 1.
const LAST: Uuid = Uuid::from_u128(u128::MAX);

/// A window: how far one claim reads, in transaction ids or microseconds;
/// its first value and bounds. A claim quicker than [`QUICK`] whose scan
/// its window stopped doubles it; one slower than [`SLOW`], or one that
/// failed, halves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    now: i64,
    min: i64,
    max: i64,
}

impl Window {
    const fn new(start: i64, min: i64, max: i64) -> Window {
        Window { now: start, min, max }
    }

    fn widen(&mut self) {
        self.now = self.now.saturating_mul(2).min(self.max);
    }

    fn narrow(&mut self) {
        self.now = (self.now / 2).max(self.min);
    }

    /// After a claim that took `took`; `binding`: the window stopped its scan.
    fn pace(&mut self, took: Duration, binding: bool) {
        if took > SLOW {
            self.narrow();
        } else if took < QUICK && binding {
            self.widen();
        }
    }
}

const XIDS: Window = Window::new(1 << 16, 1 << 10, 1 << 20);
const SECOND: i64 = 1_000_000;
const TIME: Window = Window::new(60 * SECOND, 1_000, 3600 * SECOND);
const QUICK: Duration = Duration::from_millis(5);
const SLOW: Duration = Duration::from_millis(20);

/// The claim statement's snapshot: transactions below `xmax` had ended when
/// it was taken, except those in `xip`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub xmax: Xid,
    pub xip: Vec<Xid>,
}

impl Snapshot {
    /// Did the snapshot see transaction `xid` as ended? (Not so for one it
    /// did not see, nor, usually, for the claim's own transaction: a
    /// snapshot never lists its own transaction in `xip`, and its id is at
    /// or above `xmax` until a later one has ended.)
    fn saw_end_of(&self, xid: Xid) -> bool {
        xid < self.xmax && !self.xip.contains(&xid)
    }
}

/// Which scan of the claim found a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    CameDue,
    /// The range of [`Bounds::segments`] with this index.
    Segment(usize),
}

/// One claimed row, as far as positions go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimed {
    pub source: Source,
    pub key: XidKey,
    pub available_at: Micros,
}

/// What a segment reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The rows of one transaction passed in progress; read only once it
    /// has ended (while it runs its rows are invisible, and a scan would
    /// cost an index descent for nothing).
    Behind(Xid),
    Fresh,
    /// Rows passed, due by the start of the came-due range, and not of a
    /// behind transaction.
    Sweep,
}

/// A range in `(pending_xid, id)` order: rows after `after` with a
/// `pending_xid` below `before`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub kind: Kind,
    pub after: XidKey,
    pub before: Xid,
}

/// The rows that fell due that a claim reads: passed rows due after
/// `after`, up to `until` (and the claim's now).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CameDue {
    pub after: DueKey,
    pub until: Micros,
}

/// What one claim reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounds {
    /// `None` on the first claim, which has passed nothing, and in a
    /// sweep's.
    pub came_due: Option<CameDue>,
    /// A sweep reads rows due up to this: where the came-due scan starts.
    pub due_by: Option<Micros>,
    /// Behind transactions in order and the fresh range; or a sweep.
    pub segments: Vec<Segment>,
    /// Rows passed: up to this key...
    pub passed: XidKey,
    /// ...except those of these transactions after these ids (`None`: all).
    pub behind: Vec<(Xid, Option<Uuid>)>,
}

/// Where one dispatcher's claims have got to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frontier {
    /// Rows after this key have not been looked at.
    fresh: XidKey,
    /// Transactions the fresh range passed while they were in progress, and
    /// where their own rows have got to (`None`: their first row).
    behind: BTreeMap<Xid, Option<Uuid>>,
    /// Passed rows due after this key have not been looked at again.
    came_due: Option<DueKey>,
    /// A sweep under way: passed rows after this key not looked at again.
    sweep: Option<XidKey>,
    fresh_window: Window,
    sweep_window: Window,
    due_window: Window,
    /// The fresh range is short of the last snapshot, or the came-due scan
    /// of the last claim's now.
    behind_snapshot: bool,
}

impl Default for Frontier {
    fn default() -> Self {
        Self::new()
    }
}

impl Frontier {
    /// Before the first claim: everything pending is fresh.
    pub fn new() -> Self {
        Frontier {
            fresh: (0, LAST),
            behind: BTreeMap::new(),
            came_due: None,
            sweep: None,
            fresh_window: XIDS,
            sweep_window: XIDS,
            due_window: TIME,
            behind_snapshot: true,
        }
    }

    /// Starts a sweep of every row passed, unless one is under way (or
    /// nothing was passed yet: the first claim reads everything).
    pub fn start_sweep(&mut self) {
        if self.came_due.is_some() {
            self.sweep.get_or_insert((0, LAST));
        }
    }

    /// Is there more to read than the last claim could (the fresh range or
    /// the came-due scan short of the last snapshot, a sweep under way)?
    /// Then the next claim is due at once, whether or not this one found
    /// anything.
    pub fn catching_up(&self) -> bool {
        self.behind_snapshot || self.sweep.is_some()
    }

    /// What the next claim reads.
    pub fn bounds(&self) -> Bounds {
        let mut segments: Vec<Segment> = self
            .behind
            .iter()
            .map(|(&xid, after)| Segment {
                kind: Kind::Behind(xid),
                after: after.map_or((xid.saturating_sub(1), LAST), |id| (xid, id)),
                before: xid.saturating_add(1),
            })
            .collect();
        segments.push(Segment {
            kind: Kind::Fresh,
            after: self.fresh,
            before: ahead(self.fresh.0, self.fresh_window),
        });
        let came_due =
            self.came_due.map(|after| CameDue { after, until: after.0.saturating_add(self.due_window.now) });
        self.reading(came_due, segments)
    }

    /// What the next step of the sweep under way reads.
    pub fn sweep_bounds(&self) -> Option<Bounds> {
        let after = self.sweep?;
        let before = ahead(after.0, self.sweep_window).min(self.fresh.0.saturating_add(1));
        Some(self.reading(None, vec![Segment { kind: Kind::Sweep, after, before }]))
    }

    fn reading(&self, came_due: Option<CameDue>, segments: Vec<Segment>) -> Bounds {
        Bounds {
            came_due,
            due_by: self.came_due.map(|(at, _)| at),
            segments,
            passed: self.fresh,
            behind: self.behind.iter().map(|(&xid, &after)| (xid, after)).collect(),
        }
    }

    /// After a claim with these `bounds` failed (rolled back): nothing
    /// moves, and its windows narrow, in case it was their size that made it
    /// fail (a statement deadline).
    pub fn failed(&mut self, bounds: &Bounds) {
        for segment in &bounds.segments {
            match segment.kind {
                Kind::Fresh => self.fresh_window.narrow(),
                Kind::Sweep => self.sweep_window.narrow(),
                Kind::Behind(_) => {}
            }
        }
        if bounds.came_due.is_some() {
            self.due_window.narrow();
        }
    }

    /// Moves past what a claim of up to `limit` rows with these `bounds`
    /// read, at `now` with `snapshot`, once it has committed; `took` is how
    /// long its statement ran.
    pub fn advance(
        &mut self,
        bounds: &Bounds,
        limit: usize,
        snapshot: &Snapshot,
        now: Micros,
        claimed: &[Claimed],
        took: Duration,
    ) {
        // A row updated after the snapshot was taken (set pending again,
        // or moved, by a transaction the snapshot does not see) comes back
        // as it is now, not where the scan found it: its keys say nothing
        // of how far a scan got.
        let placed = |c: &&Claimed| snapshot.saw_end_of(c.key.0);
        let from = |source: Source| claimed.iter().filter(move |c| c.source == source);

        // A regular claim (its fresh range, and the rows came due), or a
        // sweep's step.
        let regular = bounds.segments.iter().any(|s| s.kind == Kind::Fresh);
        let came_due = from(Source::CameDue).count();
        let mut due_behind = false;
        if regular {
            match bounds.came_due {
                // The first claim: nothing was passed before now.
                None => self.came_due = Some((now, LAST)),
                Some(scan) if came_due < limit => {
                    // Read to the end of its window, or to now.
                    self.came_due = Some((scan.until.min(now), LAST));
                    due_behind = scan.until < now;
                    self.due_window.pace(took, due_behind);
                }
                Some(_) => {
                    if let Some(key) =
                        from(Source::CameDue).filter(placed).map(|c| (c.available_at, c.key.1)).max()
                    {
                        self.came_due = Some(key);
                    }
                    due_behind = true;
                    self.due_window.pace(took, false);
                }
            }
        }

        // The segments are read in order under one LIMIT: all of them to
        // their end, or up to the last row returned.
        let room = limit.saturating_sub(came_due);
        let segmented = claimed.len() - came_due;
        let last = claimed
            .iter()
            .filter_map(|c| match c.source {
                Source::Segment(i) => Some(i),
                Source::CameDue => None,
            })
            .max();
        let reach = |i: usize| match last {
            _ if segmented < room => Reach::End,
            Some(last) if i < last => Reach::End,
            Some(last) if i == last => {
                from(Source::Segment(i)).filter(placed).map(|c| c.key).max().map_or(Reach::Unread, Reach::Key)
            }
            _ => Reach::Unread,
        };
        let mut fresh_behind = false;
        for (i, segment) in bounds.segments.iter().enumerate() {
            match (segment.kind, reach(i)) {
                (Kind::Behind(xid), Reach::End) if !snapshot.xip.contains(&xid) => {
                    self.behind.remove(&xid);
                }
                (Kind::Behind(xid), Reach::Key((_, id))) => {
                    self.behind.insert(xid, Some(id));
                }
                (Kind::Fresh, Reach::End) => {
                    // Read to the end of its window, or of what the
                    // snapshot could see.
                    let binding = segment.before <= snapshot.xmax;
                    let end = segment.before.min(snapshot.xmax).saturating_sub(1);
                    self.pass((end, LAST).max(self.fresh), snapshot);
                    self.fresh_window.pace(took, binding);
                    fresh_behind = binding;
                }
                (Kind::Fresh, reach) => {
                    if let Reach::Key(key) = reach {
                        self.pass(key, snapshot);
                    }
                    self.fresh_window.pace(took, false);
                    fresh_behind = true;
                }
                (Kind::Sweep, Reach::End) => {
                    let binding = segment.before <= self.fresh.0;
                    let end = (segment.before.saturating_sub(1), LAST);
                    self.sweep = (end < self.fresh).then_some(end);
                    self.sweep_window.pace(took, binding);
                }
                (Kind::Sweep, reach) => {
                    if let Reach::Key(key) = reach {
                        self.sweep = Some(key);
                    }
                    self.sweep_window.pace(took, false);
                }
                _ => {}
            }
        }
        if regular {
            self.behind_snapshot = fresh_behind || due_behind;
        }
    }

    /// Moves the fresh range to `passed`: what was in progress as it went
    /// by is behind now.
    fn pass(&mut self, passed: XidKey, snapshot: &Snapshot) {
        for &xid in snapshot.xip.iter().filter(|&&xid| xid <= passed.0) {
            self.behind.entry(xid).or_insert(None);
        }
        self.fresh = passed;
    }
}

/// The end of a window that reads on after transaction `xid`.
fn ahead(xid: Xid, window: Window) -> Xid {
    xid.saturating_add(1).saturating_add(window.now as Xid)
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

    const QUICKLY: Duration = Duration::from_millis(10);
    const START: Xid = XIDS.now as Xid;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn row(source: Source, xid: Xid, n: u128, at: Micros) -> Claimed {
        Claimed { source, key: (xid, id(n)), available_at: at }
    }

    fn snapshot(xmax: Xid, xip: &[Xid]) -> Snapshot {
        Snapshot { xmax, xip: xip.to_vec() }
    }

    fn fresh(f: &Frontier) -> usize {
        f.bounds().segments.iter().position(|s| s.kind == Kind::Fresh).unwrap()
    }

    /// A frontier after its first claim at `now` with `snapshot`, which
    /// found nothing.
    fn started(snapshot: &Snapshot, now: Micros) -> Frontier {
        let mut f = Frontier::new();
        let b = f.bounds();
        f.advance(&b, 10, snapshot, now, &[], QUICKLY);
        f
    }

    #[test]
    fn the_first_claim_reads_everything_pending_and_passes_the_snapshot() {
        let mut f = Frontier::new();
        let b = f.bounds();
        assert_eq!(b.came_due, None);
        assert_eq!(b.segments, vec![Segment { kind: Kind::Fresh, after: (0, LAST), before: START + 1 }]);
        f.advance(&b, 10, &snapshot(100, &[90, 95]), 1000, &[row(Source::Segment(0), 7, 1, 5)], QUICKLY);
        let b = f.bounds();
        assert_eq!(b.behind, vec![(90, None), (95, None)]);
        assert_eq!(b.passed, (99, LAST));
        assert_eq!(b.segments[0], Segment { kind: Kind::Behind(90), after: (89, LAST), before: 91 });
        assert_eq!(b.came_due, Some(CameDue { after: (1000, LAST), until: 1000 + TIME.now }));
        assert!(!f.catching_up());
    }

    #[test]
    fn a_fresh_range_beyond_its_window_is_read_in_windows_one_claim_after_another() {
        let mut f = Frontier::new();
        let b = f.bounds();
        // A snapshot far beyond the first window: the claim read the
        // window, found nothing, and says there is more.
        f.advance(&b, 10, &snapshot(1 << 30, &[]), 1000, &[], Duration::from_millis(1));
        assert_eq!(f.bounds().passed, (START, LAST));
        assert!(f.catching_up());
        // The window stopped the scan and the claim was quick: it widens,
        // up to its bound, and no further.
        assert_eq!(f.bounds().segments[0].before, START + 1 + 2 * START);
        for _ in 0..20 {
            let b = f.bounds();
            f.advance(&b, 10, &snapshot(1 << 30, &[]), 1000, &[], Duration::from_millis(1));
        }
        let b = f.bounds();
        assert_eq!(b.segments[0].before - b.passed.0, XIDS.max as Xid + 1);
        // A slow claim narrows it; so does a failed one.
        f.advance(&b, 10, &snapshot(1 << 30, &[]), 1000, &[], Duration::from_secs(1));
        let b = f.bounds();
        assert_eq!(b.segments[0].before - b.passed.0, XIDS.max as Xid / 2 + 1);
        f.failed(&b);
        let b = f.bounds();
        assert_eq!(b.segments[0].before - b.passed.0, XIDS.max as Xid / 4 + 1);
    }

    #[test]
    fn a_window_that_did_not_stop_its_scan_does_not_widen() {
        let mut f = started(&snapshot(100, &[]), 1000);
        for _ in 0..10 {
            let b = f.bounds();
            f.advance(&b, 10, &snapshot(100, &[]), 1000, &[], Duration::from_millis(1));
        }
        let b = f.bounds();
        assert_eq!(b.segments[0].before - b.passed.0, START + 1);
    }

    #[test]
    fn a_transaction_in_progress_when_passed_is_read_once_it_has_ended() {
        let mut f = started(&snapshot(100, &[90]), 1000);
        let b = f.bounds();
        assert_eq!(b.segments.len(), 2);
        f.advance(
            &b,
            10,
            &snapshot(110, &[90, 105]),
            1100,
            &[row(Source::Segment(1), 101, 1, 1050)],
            QUICKLY,
        );
        assert_eq!(f.bounds().behind, vec![(90, None), (105, None)]);
        // 90 committed with two rows, 105 still runs.
        let b = f.bounds();
        let rows = [row(Source::Segment(0), 90, 5, 900), row(Source::Segment(0), 90, 6, 900)];
        f.advance(&b, 10, &snapshot(120, &[105]), 1200, &rows, QUICKLY);
        assert_eq!(f.bounds().behind, vec![(105, None)]);
        assert_eq!(f.bounds().passed, (119, LAST));
    }

    #[test]
    fn a_large_late_transaction_is_read_on_from_its_last_row() {
        let mut f = started(&snapshot(100, &[90]), 1000);
        let b = f.bounds();
        let rows: Vec<_> = (0..3).map(|n| row(Source::Segment(0), 90, n, 900)).collect();
        f.advance(&b, 3, &snapshot(130, &[]), 1100, &rows, QUICKLY);
        let b = f.bounds();
        assert_eq!(b.segments[0], Segment { kind: Kind::Behind(90), after: (90, id(2)), before: 91 });
        assert_eq!(b.behind, vec![(90, Some(id(2)))]);
        // The fresh range was not read: it stays where it was, and there
        // is more to read at once.
        assert_eq!(b.passed, (99, LAST));
        assert!(f.catching_up());
        f.advance(&b, 3, &snapshot(130, &[]), 1200, &[row(Source::Segment(0), 90, 3, 900)], QUICKLY);
        assert_eq!(f.bounds().behind, vec![]);
        assert_eq!(f.bounds().passed, (129, LAST));
        assert!(!f.catching_up());
    }

    #[test]
    fn a_fresh_range_cut_by_the_limit_keeps_what_it_passed_in_progress() {
        let mut f = started(&snapshot(100, &[]), 1000);
        let b = f.bounds();
        let i = fresh(&f);
        // 104 ran while rows of 103 and 107 were read; 110 is beyond the cut.
        let rows = [row(Source::Segment(i), 103, 1, 1000), row(Source::Segment(i), 107, 1, 1000)];
        f.advance(&b, 2, &snapshot(120, &[104, 110]), 1100, &rows, QUICKLY);
        let b = f.bounds();
        assert_eq!(b.passed, (107, id(1)));
        assert_eq!(b.behind, vec![(104, None)]);
    }

    #[test]
    fn rows_came_due_are_read_first_from_the_last_claim_on_within_a_window_of_time() {
        let mut f = started(&snapshot(100, &[]), 1000);
        let b = f.bounds();
        let rows = [row(Source::CameDue, 50, 1, 1010), row(Source::CameDue, 60, 2, 1020)];
        f.advance(&b, 5, &snapshot(100, &[]), 1100, &rows, QUICKLY);
        assert_eq!(f.bounds().came_due.unwrap().after, (1100, LAST));
        let b = f.bounds();
        let rows = [row(Source::CameDue, 50, 3, 1130), row(Source::CameDue, 51, 4, 1140)];
        f.advance(&b, 2, &snapshot(110, &[]), 1200, &rows, QUICKLY);
        assert_eq!(f.bounds().came_due.unwrap().after, (1140, id(4)));
        // They took the whole claim: the fresh range stays.
        assert_eq!(f.bounds().passed, (99, LAST));
        // After a long pause, one window of time at a time.
        let later = 1200 + 10 * TIME.now;
        let b = f.bounds();
        f.advance(&b, 2, &snapshot(110, &[]), later, &[], QUICKLY);
        assert_eq!(f.bounds().came_due.unwrap().after, (1140 + TIME.now, LAST));
        assert!(f.catching_up());
    }

    #[test]
    fn a_sweep_reads_everything_passed_in_windows_and_ends_at_the_fresh_range() {
        let mut f = started(&snapshot(1 << 17, &[]), 1000);
        let b = f.bounds();
        f.advance(&b, 10, &snapshot(1 << 17, &[]), 1000, &[], QUICKLY);
        assert!(!f.catching_up());
        assert_eq!(f.sweep_bounds(), None);
        f.start_sweep();
        assert!(f.sweep_bounds().is_some() && f.catching_up());
        // The regular claims go on as before; the sweep has claims of its own.
        assert!(f.bounds().segments.iter().all(|s| s.kind != Kind::Sweep));
        let b = f.sweep_bounds().unwrap();
        assert_eq!((b.came_due, b.due_by), (None, Some(1000)));
        assert_eq!(b.segments, vec![Segment { kind: Kind::Sweep, after: (0, LAST), before: START + 1 }]);
        f.advance(&b, 10, &snapshot(1 << 17, &[]), 1100, &[row(Source::Segment(0), 5, 1, 10)], QUICKLY);
        // Read to the end of its window: on from there; came-due untouched.
        assert_eq!(f.sweep_bounds().unwrap().segments[0].after, (START, LAST));
        assert_eq!(f.bounds().came_due.unwrap().after, (1000, LAST));
        let b = f.sweep_bounds().unwrap();
        f.advance(&b, 10, &snapshot(1 << 17, &[]), 1200, &[], QUICKLY);
        assert_eq!(f.sweep_bounds(), None);
    }

    #[test]
    fn a_row_updated_after_the_snapshot_does_not_move_a_position() {
        let mut f = started(&snapshot(100, &[]), 1000);
        let b = f.bounds();
        let i = fresh(&f);
        // The scan locked (101, 1) and a row it found at (102, 5), which a
        // transaction the snapshot does not see (150) has set pending again
        // since: it comes back with its new key, far beyond the scan.
        let rows = [row(Source::Segment(i), 101, 1, 1000), row(Source::Segment(i), 150, 5, 1000)];
        f.advance(&b, 2, &snapshot(140, &[]), 1100, &rows, QUICKLY);
        assert_eq!(f.bounds().passed, (101, id(1)));
        // Only such rows: it stays.
        let b = f.bounds();
        f.advance(&b, 1, &snapshot(140, &[]), 1200, &[row(Source::Segment(i), 150, 6, 1000)], QUICKLY);
        assert_eq!(f.bounds().passed, (101, id(1)));
    }

    #[test]
    fn the_fresh_range_never_moves_back() {
        let mut f = started(&snapshot(100, &[]), 1000);
        let b = f.bounds();
        // An older snapshot than the last one: read to its end, the
        // position stays.
        f.advance(&b, 10, &snapshot(90, &[]), 1100, &[], QUICKLY);
        assert_eq!(f.bounds().passed, (99, LAST));
    }
}
