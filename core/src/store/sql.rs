//! What a host gives the store: the statements of `sql/worker/` and
//! `sql/keys/` run with typed arguments, in transactions it opens with a
//! deadline. In the server, SPI with plans prepared once (the extension's
//! `src/worker/store.rs`); outside it, a PostgreSQL client (the sidecar).

use std::fmt;
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Declares [`Stmt`]: each statement, its file and its parameters' types.
macro_rules! statements {
    ($($name:ident = $file:literal ($($param:ident),*);)*) => {
        /// A statement the dispatchers run, one per file.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Stmt {
            $($name,)*
        }

        impl Stmt {
            /// Every statement, in declaration order.
            pub const ALL: &'static [Stmt] = &[$(Stmt::$name,)*];

            /// Its place in [`Stmt::ALL`].
            pub fn index(self) -> usize {
                self as usize
            }

            /// Its SQL.
            pub fn sql(self) -> &'static str {
                match self {
                    $(Stmt::$name => include_str!(concat!("../../../sql/", $file)),)*
                }
            }

            /// The types of its parameters, `$1` first.
            pub fn params(self) -> &'static [Type] {
                match self {
                    $(Stmt::$name => &[$(Type::$param),*],)*
                }
            }
        }
    };
}

statements! {
    FlushBatches = "worker/flush_batches.sql" (Int8, Int8Array, Int8);
    Accumulating = "worker/accumulating.sql" ();
    FailBatch = "worker/fail_batch.sql" (Int8, Text, Int8);
    LockCursor = "worker/lock_cursor.sql" ();
    RestoreTurn = "worker/restore_turn.sql" ();
    Claim = "worker/claim.sql" (Int4, Int4, Int8);
    CameDue = "worker/came_due.sql" (Int4, Float8);
    NextDue = "worker/next_due.sql" (Int8Array, Float8);
    DueBound = "worker/due_bound.sql" ();
    DueFloor = "worker/due_floor.sql" (Float8, Float8);
    MarkDispatched = "worker/mark_dispatched.sql" (Int8, Int4, Bool);
    LockEvents = "worker/lock_events.sql" (UuidArray);
    MarkFailed = "worker/mark_failed.sql" (UuidArray, TextArray, TextArray, TextArray, Float8Array, BoolArray);
    Release = "worker/release.sql" (UuidArray, TextArray);
    Abandon = "worker/abandon.sql" (Int4, Float8, Int4);
    RelineAbandoned = "worker/reline_abandoned.sql" (Int8Array);
    SettleReported = "worker/settle_reported.sql" (Int8Array);
    SweepStrays = "worker/sweep_strays.sql" (Int4);
    TriggersOff = "worker/triggers_off.sql" ();
    RelineRestored = "worker/reline_restored.sql" (Int4, Int8, Int8);
    FireAlways = "worker/fire_always.sql" (Int4);
    SettleUnacked = "worker/settle_unacked.sql" (Float8, Int4);
    SweepUnacked = "worker/sweep_unacked.sql" (Int8Array, Int4);
    Rotate = "worker/rotate.sql" (Float8, Int4, Bool);
    ForgetBatches = "worker/forget_batches.sql" (Int4);
    ApplyReports = "worker/apply_reports.sql" (UuidArray, UuidArray, TextArray, TextArray);
    Home = "worker/home.sql" (Oid, Bool);
    LockKeys = "keys/lock.sql" (TextArray, Int8Array, Bool);
    PassKeys = "keys/pass.sql" (UuidArray, TextArray, Int8Array, Bool, Bool);
    KeyOf = "keys/key_of.sql" (Uuid);
    AckLock = "ack_lock.sql" (Uuid);
    Ack = "ack.sql" (Uuid, Uuid);
    SweepKeys = "worker/sweep_keys.sql" (Bool, Bool, Int4);
    PurgeInbox = "worker/purge_inbox.sql" (Float8, Int4);
    InLine = "worker/in_line.sql" (Float8);
    GenerationsBegan = "worker/generations_began.sql" ();
    Reused = "worker/reused.sql" (UuidArray, Int8Array, TextArray);
}

impl Stmt {
    /// Whether the statement only reads: a host may run it without taking
    /// a transaction id (pgrx's `update` takes one).
    pub fn reads_only(self) -> bool {
        matches!(self, Stmt::InLine | Stmt::TriggersOff)
    }
}

/// The type of a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Type {
    Bool,
    Int4,
    Int8,
    Float8,
    Text,
    Oid,
    Uuid,
    Int8Array,
    Float8Array,
    BoolArray,
    TextArray,
    UuidArray,
}

/// An argument, of the [`Type`] of its parameter; `None` is NULL.
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    Bool(bool),
    Int4(Option<i32>),
    Int8(Option<i64>),
    Float8(f64),
    Text(String),
    Oid(u32),
    Uuid(Option<Uuid>),
    Int8Array(Vec<i64>),
    Float8Array(Vec<f64>),
    BoolArray(Vec<bool>),
    /// Elements may be NULL.
    TextArray(Vec<Option<String>>),
    UuidArray(Vec<Uuid>),
}

impl Arg {
    /// A `text[]` of values none of which is NULL.
    pub fn texts(values: impl IntoIterator<Item = String>) -> Arg {
        Arg::TextArray(values.into_iter().map(Some).collect())
    }
}

/// A value of a row, by kind: every integer type is `Int`, every text-like
/// type `Text`.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Value {
    #[default]
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
    Uuid(Uuid),
}

/// What a statement returned: its rows, and how many it touched (rows
/// returned, or changed by a statement that returns none).
#[derive(Debug, Default)]
pub struct Rows {
    pub rows: Vec<Vec<Value>>,
    pub touched: u64,
}

/// A row's column as a Rust value: `Ok(None)` for NULL, the value back
/// for a column of another kind (a statement and its reader disagree).
pub trait Column: Sized {
    fn from_value(value: Value) -> Result<Option<Self>, Value>;
}

macro_rules! column {
    ($type:ty, $variant:ident) => {
        impl Column for $type {
            fn from_value(value: Value) -> Result<Option<Self>, Value> {
                match value {
                    Value::Null => Ok(None),
                    Value::$variant(v) => Ok(Some(v)),
                    other => Err(other),
                }
            }
        }
    };
}

column!(bool, Bool);
column!(i64, Int);
column!(f64, Float);
column!(String, Text);
column!(Uuid, Uuid);

/// Column `index` (from 0) of `row`, copied.
pub fn get<T: Column>(row: &[Value], index: usize) -> Result<Option<T>, DbError> {
    convert(row.get(index).cloned().unwrap_or(Value::Null), index)
}

/// Column `index` (from 0) of `row`, moved out (NULL left in its place):
/// for the texts of a claim's rows, read once.
pub fn take<T: Column>(row: &mut [Value], index: usize) -> Result<Option<T>, DbError> {
    convert(row.get_mut(index).map(std::mem::take).unwrap_or_default(), index)
}

fn convert<T: Column>(value: Value, index: usize) -> Result<Option<T>, DbError> {
    T::from_value(value).map_err(|value| {
        DbError::internal(format!("column {} is {value:?}, not a {}", index + 1, std::any::type_name::<T>()))
    })
}

/// An error PostgreSQL raised (with its SQLSTATE), or the host met.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbError {
    /// The SQLSTATE, five characters.
    pub code: String,
    pub message: String,
}

/// SQLSTATE `XX000`, internal_error: for what the host itself refuses.
const INTERNAL: &str = "XX000";

impl DbError {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> DbError {
        DbError { code: code.into(), message: message.into() }
    }

    pub fn internal(message: impl Into<String>) -> DbError {
        DbError::new(INTERNAL, message)
    }

    /// lock_not_available: a lock not granted within `lock_timeout`.
    pub fn is_lock_timeout(&self) -> bool {
        self.code == "55P03"
    }

    /// Whether the same work may succeed later: a lock, a deadlock, a
    /// serialization failure, resources, a cancel (the deadline) (SQLSTATE
    /// classes 40 and 53, lock_not_available, query_canceled).
    pub fn passes(&self) -> bool {
        self.code.starts_with("40")
            || self.code.starts_with("53")
            || self.is_lock_timeout()
            || self.code == "57014"
    }
}

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DbError {}

/// A transaction under way.
pub trait Tx {
    /// Runs `stmt` with `args` (of [`Stmt::params`]).
    fn run(&mut self, stmt: Stmt, args: &[Arg]) -> Result<Rows, DbError>;

    /// Runs `body` in a subtransaction (a savepoint), cancelled at `until`
    /// at the latest: an error inside rolls back what `body` did, and the
    /// transaction goes on. A shutdown is not caught.
    fn subtransaction(
        &mut self,
        until: Instant,
        body: &mut dyn FnMut(&mut dyn Tx) -> Result<(), DbError>,
    ) -> Result<(), DbError>;

    /// Makes this transaction's commit wait for its WAL to be flushed
    /// (dispatchers commit with `synchronous_commit = off`): for a commit
    /// that something done outside PostgreSQL right after relies on.
    fn durable_commit(&mut self) -> Result<(), DbError> {
        self.run_text("SET LOCAL synchronous_commit TO on")
    }

    /// Runs a statement of no argument that is not one of [`Stmt`].
    fn run_text(&mut self, sql: &'static str) -> Result<(), DbError>;

    /// The time left before the transaction's deadline.
    fn time_left(&self) -> Duration;
}

/// Runs `body` in a subtransaction of `tx` (see [`Tx::subtransaction`]),
/// returning what it returns.
pub fn subtransaction<R>(
    tx: &mut dyn Tx,
    until: Instant,
    body: impl FnOnce(&mut dyn Tx) -> Result<R, DbError>,
) -> Result<R, DbError> {
    let mut body = Some(body);
    let mut result = None;
    tx.subtransaction(until, &mut |tx| {
        let body = body.take().expect("a subtransaction runs its body once");
        result = Some(body(tx)?);
        Ok(())
    })?;
    result.ok_or_else(|| DbError::internal("a subtransaction ended without running its body"))
}

/// What a host opens transactions on.
pub trait Db {
    /// Runs `body` in a transaction of its own, cancelled once it has run
    /// `deadline`, and commits it; an error rolls it back. `Ok(false)`
    /// when the outbox is not installed in the database (nothing ran); an
    /// error when it is installed at another version than this code's.
    fn transaction(
        &mut self,
        deadline: Duration,
        body: &mut dyn FnMut(&mut dyn Tx) -> Result<(), DbError>,
    ) -> Result<bool, DbError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_has_its_parameters() {
        for stmt in Stmt::ALL {
            let highest = (1..=9).rev().find(|n| stmt.sql().contains(&format!("${n}"))).unwrap_or(0);
            assert_eq!(stmt.params().len(), highest, "{stmt:?}");
        }
    }

    #[test]
    fn every_statement_is_at_its_index() {
        for (i, stmt) in Stmt::ALL.iter().enumerate() {
            assert_eq!(stmt.index(), i);
        }
    }

    #[test]
    fn columns_are_read_by_kind() {
        let row = vec![Value::Int(7), Value::Null, Value::Text("x".into())];
        assert_eq!(get::<i64>(&row, 0), Ok(Some(7)));
        assert_eq!(get::<String>(&row, 1), Ok(None));
        assert_eq!(get::<String>(&row, 5), Ok(None));
        assert!(get::<bool>(&row, 2).is_err());
    }

    #[test]
    fn passing_errors_are_told_by_their_sqlstate() {
        for code in ["40001", "40P01", "53200", "55P03", "57014"] {
            assert!(DbError::new(code, "").passes(), "{code}");
        }
        for code in ["23505", "22023", "57P01", "XX000"] {
            assert!(!DbError::new(code, "").passes(), "{code}");
        }
    }
}
