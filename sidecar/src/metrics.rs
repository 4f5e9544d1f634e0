//! `/metrics` (`--metrics-listen`): the Prometheus text exposition of the
//! process's counters and histograms, its dispatchers' gauges and the
//! database's gauges, as the exporter (`python -m outbox_dispatch.exporter`)
//! serves the library's: the same families, each sample labelled
//! `database`, and `outbox_up` and `outbox_scrape_duration_seconds` for the
//! database, so that the dashboard and the alert rules of `contrib/` work
//! unchanged on either host. A scrape the database does not answer in time
//! shows `outbox_up` 0 and nothing else of it, as the exporter's does.
//! Beside it `/healthz` (the process answers) and `/readyz` (a dispatcher
//! holds a number, on a connection to the database, with its broker
//! connected: 503 otherwise). Plain HTTP/1.1, one request per connection,
//! on a thread of its own: a connection is served within [`TIMEOUT`] in
//! all (its request read up to [`MOST_REQUEST_BYTES`], the answer
//! written), and the lingering close after it within [`LINGER`], so that a
//! client that sends garbage, too much, nothing or a byte at a time ties up
//! nothing for long. The database's gauges are read on a connection of the
//! endpoint's own, given up after [`GAUGES_TIMEOUT`]: a slow scrape, or a
//! connection that does not answer, holds up no dispatcher.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use postgres::Client;

use outbox_core::exposition::{self, Family, Kind, Sample};
use outbox_core::guc::{self, Parsed};
use outbox_core::metrics::{self, Shown};

use crate::connect::{chain, pin_session, Connector};
use crate::host::Process;
use crate::log;

/// The most bytes of a request's head read.
const MOST_REQUEST_BYTES: usize = 8192;
/// The most bytes read after an answer, and for how long, before closing.
const LINGER_BYTES: u64 = 1 << 20;
const LINGER: Duration = Duration::from_secs(1);
/// How long a client has to send its request and read the answer.
const TIMEOUT: Duration = Duration::from_secs(5);
/// How long the database's gauges may take to read (a connect included).
const GAUGES_TIMEOUT: Duration = Duration::from_secs(3);

/// Serves `/metrics` on `listener` until the process ends.
pub fn serve(listener: TcpListener, process: Arc<Process>, connector: Connector) {
    let database = connector.database().to_string();
    let mut gauges = Gauges { connector, client: None, late: None };
    for stream in listener.incoming() {
        if process.stopping() {
            return;
        }
        match stream {
            Ok(stream) => {
                if let Err(e) = answer(stream, &process, &database, &mut gauges) {
                    log::warning(&format!("/metrics: a request failed: {e}"));
                }
            }
            Err(e) => log::warning(&format!("/metrics: accepting a connection: {e}")),
        }
    }
}

fn answer(stream: TcpStream, process: &Process, database: &str, gauges: &mut Gauges) -> std::io::Result<()> {
    let mut stream = Deadline { stream, until: Instant::now() + TIMEOUT };
    let (status, body) = match read_request(&mut stream)? {
        Request::Metrics => ("200 OK", exposition::render(&scrape(process, database, gauges))),
        Request::Health => ("200 OK", "alive\n".to_string()),
        Request::Ready => readiness(&process.shown()),
        Request::NotFound => {
            ("404 Not Found", "only /metrics, /healthz and /readyz are served here\n".to_string())
        }
        Request::NotGet => ("405 Method Not Allowed", "only GET is served here\n".to_string()),
        Request::Bad => ("400 Bad Request", "not an HTTP request\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    // A lingering close: what the client still sends (a request too long)
    // is read, up to a bound, so that it gets the answer rather than a
    // reset.
    stream.stream.shutdown(Shutdown::Write)?;
    stream.until = Instant::now() + LINGER;
    std::io::copy(&mut (&mut stream).take(LINGER_BYTES), &mut std::io::sink()).map(|_| ())
}

/// A connection whose every read and write ends by one instant.
struct Deadline {
    stream: TcpStream,
    until: Instant,
}

impl Deadline {
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the connection's time ran out"));
        }
        Ok(left)
    }
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        self.stream.read(buf)
    }
}

impl Write for Deadline {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Request {
    Metrics,
    Health,
    Ready,
    NotFound,
    NotGet,
    Bad,
}

/// Reads a request's head (up to its blank line, at most
/// [`MOST_REQUEST_BYTES`]) and tells what it asks.
fn read_request(stream: &mut impl Read) -> std::io::Result<Request> {
    let mut head = Vec::new();
    let mut buffer = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MOST_REQUEST_BYTES {
            return Ok(Request::Bad);
        }
        let n = stream.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buffer[..n]);
    }
    Ok(request(&head))
}

fn request(head: &[u8]) -> Request {
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let Ok(line) = std::str::from_utf8(line) else {
        return Request::Bad;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Bad;
    };
    if !version.starts_with("HTTP/1.") {
        return Request::Bad;
    }
    if method != "GET" {
        return Request::NotGet;
    }
    match target.split('?').next() {
        Some("/metrics") => Request::Metrics,
        Some("/healthz") => Request::Health,
        Some("/readyz") => Request::Ready,
        _ => Request::NotFound,
    }
}

/// Whether the process delivers: a dispatcher is shown only while it
/// holds a number on a session of the database (its row goes with the
/// session), and is ready when its broker is connected and its last
/// statement did not fail.
fn readiness(dispatchers: &[Shown]) -> (&'static str, String) {
    let ready = dispatchers.iter().filter(|d| d.running && d.connected && !d.blocked).count();
    match ready {
        0 => (
            "503 Service Unavailable",
            format!(
                "not ready: of {} dispatcher(s) holding a number, none has the database and the broker \
                 (outbox.workers and the log say why)\n",
                dispatchers.len()
            ),
        ),
        n => ("200 OK", format!("ready: {n} of {} dispatcher(s) deliver\n", dispatchers.len())),
    }
}

/// Everything a scrape shows, each sample labelled `database`: when the
/// database's gauges are read in time, the process's counters, its
/// dispatchers' gauges and the database's; then whether they were
/// ([`target_families`]).
fn scrape(process: &Process, database: &str, gauges: &mut Gauges) -> Families {
    let started = Instant::now();
    let read = gauges.read();
    let answered = read.is_some();
    let mut families = read.map_or_else(Vec::new, |read| served(process, read));
    families.extend(target_families(answered, started.elapsed()));
    labelled(families, database)
}

/// The process's counters, its dispatchers' gauges and the database's
/// gauges `read`. A family only the library's SQL functions count
/// (`outbox_ack()`'s acknowledgements, `outbox_inbox_claim()`'s
/// duplicates) keeps its HELP and TYPE, without those samples: a host
/// without the library cannot count them, and shows none rather than a
/// zero.
fn served(process: &Process, read: Families) -> Families {
    let mut families: Families = process
        .counters
        .families()
        .into_iter()
        .map(|(family, samples)| {
            (family, samples.into_iter().filter(|s| !metrics::counted_in_sql(s)).collect())
        })
        .collect();
    families.extend(metrics::dispatcher_families(process.shown().into_iter()));
    families.extend(read);
    families
}

/// The families the exporter adds for each database it scrapes, with the
/// same names and help: whether the database answered, and how long
/// asking it took.
fn target_families(answered: bool, took: Duration) -> Families {
    let up = Family {
        name: "outbox_up",
        help: "Whether the database answered the last scrape (1) or not (0).",
        kind: Kind::Gauge,
    };
    let duration = Family {
        name: "outbox_scrape_duration_seconds",
        help: "How long the last scrape of the database took.",
        kind: Kind::Gauge,
    };
    vec![
        (up, vec![Sample::new(up.name, f64::from(u8::from(answered)))]),
        (duration, vec![Sample::new(duration.name, took.as_secs_f64())]),
    ]
}

/// `families` with `database` as the first label of every sample.
fn labelled(families: Families, database: &str) -> Families {
    families
        .into_iter()
        .map(|(family, samples)| {
            let samples = samples
                .into_iter()
                .map(|mut s| {
                    s.labels.insert(0, ("database", database.to_string()));
                    s
                })
                .collect();
            (family, samples)
        })
        .collect()
}

/// The database's gauges, on the endpoint's own connection.
struct Gauges {
    connector: Connector,
    client: Option<Client>,
    /// A read that did not answer in time, still under way: no other is
    /// started before it ends (a connection that hangs, scraped again and
    /// again, must not cost a thread and a connection each time).
    late: Option<mpsc::Receiver<Result<(Client, Families), String>>>,
}

impl Gauges {
    /// The gauges, read on a thread of their own and waited for
    /// [`GAUGES_TIMEOUT`] at most; `None` when they are not had in time. A
    /// read that does not answer in time is left to end on its own, and
    /// the scrapes until it does are served without the database.
    fn read(&mut self) -> Option<Families> {
        if let Some(late) = &self.late {
            match late.try_recv() {
                Err(mpsc::TryRecvError::Empty) => return None,
                Ok(Ok((client, _))) => self.client = Some(client),
                Ok(Err(_)) | Err(mpsc::TryRecvError::Disconnected) => {}
            }
            self.late = None;
        }
        let (client, connector) = (self.client.take(), self.connector.clone());
        let (sent, answered) = mpsc::channel();
        let spawned = std::thread::Builder::new().name("gauges".into()).spawn(move || {
            let _ = sent.send(read_gauges(client, &connector));
        });
        if let Err(e) = spawned {
            log::warning(&format!("/metrics: a thread for the database's gauges: {e}"));
            return None;
        }
        match answered.recv_timeout(GAUGES_TIMEOUT) {
            Ok(Ok((client, families))) => {
                self.client = Some(client);
                Some(families)
            }
            Ok(Err(why)) => {
                log::warning(&format!("/metrics: the database's gauges: {why}"));
                None
            }
            Err(_) => {
                log::warning(&format!(
                    "/metrics: the database's gauges took more than {}s: served as down (outbox_up 0) until \
                     that read ends",
                    GAUGES_TIMEOUT.as_secs()
                ));
                self.late = Some(answered);
                None
            }
        }
    }
}

/// Metric families and their samples.
type Families = Vec<(Family, Vec<Sample>)>;

/// The database's gauges on `client`, or on a new connection.
fn read_gauges(client: Option<Client>, connector: &Connector) -> Result<(Client, Families), String> {
    let mut c = match client.filter(|c| !c.is_closed()) {
        Some(c) => c,
        None => {
            let mut c = connector.connect(GAUGES_TIMEOUT)?;
            pin_session(&mut c)?;
            c.batch_execute(&format!("SET statement_timeout = {}", GAUGES_TIMEOUT.as_millis()))
                .map_err(|e| chain(&e))?;
            c
        }
    };
    let retention = c
        .query_one("SELECT outbox.setting('outbox.retention')", &[])
        .map_err(|e| chain(&e))?
        .get::<_, Option<String>>(0);
    let declared = guc::declared("outbox.retention").expect("a declared setting");
    let seconds = match retention.map(|v| declared.parse(&v)) {
        Some(Ok(Parsed::Int(s))) => s,
        _ => match declared.default() {
            Parsed::Int(s) => s,
            _ => 0,
        },
    };
    let rows = c.query(metrics::GAUGES_SQL, &[&seconds]).map_err(|e| chain(&e))?;
    let families = metrics::database_families(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))))?;
    Ok((c, families))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_get_of_metrics_is_served() {
        assert_eq!(request(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Request::Metrics);
        assert_eq!(request(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Request::Metrics);
        assert_eq!(request(b"GET /healthz HTTP/1.1\r\n\r\n"), Request::Health);
        assert_eq!(request(b"GET /readyz HTTP/1.0\r\n\r\n"), Request::Ready);
        assert_eq!(request(b"GET / HTTP/1.1\r\n\r\n"), Request::NotFound);
        assert_eq!(request(b"POST /metrics HTTP/1.1\r\n\r\n"), Request::NotGet);
        for garbage in [
            &b"\xff\xfe\r\n\r\n"[..],
            b"GET /metrics\r\n\r\n",
            b"GET  /metrics HTTP/1.1\r\n",
            b"",
            b"SSH-2.0",
        ] {
            assert_eq!(request(garbage), Request::Bad, "{garbage:?}");
        }
    }

    #[test]
    fn a_request_too_long_is_bad_without_being_read_whole() {
        let mut endless = std::io::repeat(b'a');
        assert_eq!(read_request(&mut endless).unwrap(), Request::Bad);
    }

    #[test]
    fn every_sample_names_its_database_first_and_whether_it_answered() {
        let counter = Family { name: "outbox_x", help: "X.", kind: Kind::Counter };
        let read = vec![(counter, vec![Sample::new("outbox_x_total", 2.0).label("reason", "timeout")])];
        let mut families = read;
        families.extend(target_families(true, Duration::from_millis(250)));
        assert_eq!(
            exposition::render(&labelled(families, "app \"1\"")),
            "# HELP outbox_x_total X.\n# TYPE outbox_x_total counter\n\
             outbox_x_total{database=\"app \\\"1\\\"\",reason=\"timeout\"} 2\n\
             # HELP outbox_up Whether the database answered the last scrape (1) or not (0).\n\
             # TYPE outbox_up gauge\noutbox_up{database=\"app \\\"1\\\"\"} 1\n\
             # HELP outbox_scrape_duration_seconds How long the last scrape of the database took.\n\
             # TYPE outbox_scrape_duration_seconds gauge\n\
             outbox_scrape_duration_seconds{database=\"app \\\"1\\\"\"} 0.25\n"
        );
        let [(_, up), _] = &target_families(false, Duration::ZERO)[..] else { panic!("two families") };
        assert_eq!(up, &vec![Sample::new("outbox_up", 0.0)]);
    }

    #[test]
    fn ready_when_a_dispatcher_has_the_database_and_the_broker() {
        let shown = |running, connected, blocked| Shown { running, connected, blocked };
        assert_eq!(readiness(&[]).0, "503 Service Unavailable");
        assert_eq!(readiness(&[shown(true, false, false)]).0, "503 Service Unavailable");
        assert_eq!(readiness(&[shown(true, true, true)]).0, "503 Service Unavailable");
        assert_eq!(readiness(&[shown(false, true, false)]).0, "503 Service Unavailable");
        assert_eq!(readiness(&[shown(true, false, false), shown(true, true, false)]).0, "200 OK");
    }
}
