//! RESP2, the Redis wire protocol: commands out, replies in.
//!
//! Replies are decoded as they arrive ([`Decoder`]), within [`Limits`] that
//! bound the memory a peer can make us use. Nothing here touches a socket,
//! so every case is a plain unit test.

use std::fmt;

/// A reply, as Redis sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`
    Status(String),
    /// `-ERR ...`: the command failed; the text starts with its kind.
    Error(String),
    /// `:42`
    Integer(i64),
    /// `$n` bulk string; `None` is the null bulk string.
    Bulk(Option<Vec<u8>>),
    /// `*n`; `None` is the null array.
    Array(Option<Vec<Reply>>),
}

impl Reply {
    /// What the reply is, by kind and size, for an error message: never its
    /// content, which a peer chooses (and which may be megabytes).
    pub fn describe(&self) -> String {
        match self {
            Reply::Status(s) if s.len() <= 32 => format!("the status +{s}"),
            Reply::Status(s) => format!("a status of {} bytes", s.len()),
            Reply::Error(e) => format!("an error of {} bytes", e.len()),
            Reply::Integer(n) => format!("the integer {n}"),
            Reply::Bulk(None) | Reply::Array(None) => "a null".into(),
            Reply::Bulk(Some(b)) => format!("a bulk string of {} bytes", b.len()),
            Reply::Array(Some(items)) => format!("an array of {} elements", items.len()),
        }
    }

    /// The reply as text, for status and bulk replies.
    pub fn text(&self) -> Option<String> {
        match self {
            Reply::Status(s) => Some(s.clone()),
            Reply::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }
}

/// The stream does not hold a RESP reply: the connection cannot be trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolError(pub String);

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Redis protocol error: {}", self.0)
    }
}

/// Appends one command (an array of bulk strings) to `out`.
pub fn command<A: AsRef<[u8]>>(out: &mut Vec<u8>, args: &[A]) {
    header(out, b'*', args.len());
    for arg in args {
        bulk(out, arg.as_ref());
    }
}

/// Appends a command made of a name, a key and many values (`LPUSH key v...`)
/// without collecting the arguments first.
pub fn command_with_values<V: AsRef<[u8]>>(out: &mut Vec<u8>, name: &str, key: &str, values: &[V]) {
    header(out, b'*', 2 + values.len());
    bulk(out, name.as_bytes());
    bulk(out, key.as_bytes());
    for value in values {
        bulk(out, value.as_ref());
    }
}

/// The bytes one argument of `n` bytes takes in a command.
pub fn bulk_len(n: usize) -> usize {
    1 + digits(n) + 2 + n + 2
}

fn digits(mut n: usize) -> usize {
    let mut d = 1;
    while n >= 10 {
        n /= 10;
        d += 1;
    }
    d
}

fn header(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn bulk(out: &mut Vec<u8>, data: &[u8]) {
    header(out, b'$', data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// Deepest nesting of arrays accepted; Redis's replies to our commands are
/// flat or one level deep.
const MAX_DEPTH: usize = 8;

/// The most a reply may be: larger ones are a protocol error, the
/// connection is dropped, and memory per connection stays bounded. The
/// largest reply our commands can legitimately get is a read of 1000
/// reports of at most 16 KiB each (`Sink::reports` cuts bigger ones on the
/// server's side); every other is a few hundred bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of one reply on the wire, its nested replies included.
    pub bytes: usize,
    /// Replies nested in one reply, at every depth together.
    pub elements: usize,
    /// Bytes of one status or error line, or of a length.
    pub line: usize,
}

impl Limits {
    /// A read of reports: the one large reply (1000 reports of at most
    /// 16 KiB each).
    pub const REPORTS: Limits = Limits { bytes: 17 << 20, elements: 16 * 1024, line: 64 * 1024 };
    /// Every other reply our commands get: an integer, a status, a few
    /// short strings (ROLE, CONFIG GET, a sentinel's answer).
    pub const REPLY: Limits = Limits { bytes: 64 * 1024, elements: 1024, line: 16 * 1024 };
}

/// The most buffer capacity a link keeps between large replies.
const KEPT_CAPACITY: usize = 64 * 1024;

/// Decodes replies as their bytes arrive, each byte once: whole scalars are
/// taken off the front of the buffer as soon as they are complete, and the
/// arrays they belong to are built up across reads. A reply over the
/// [`Limits`] is refused as soon as its header says so, before any of it
/// is kept.
#[derive(Debug)]
pub struct Decoder {
    limits: Limits,
    /// Arrays being filled: elements still to come, and those received.
    open: Vec<(usize, Vec<Reply>)>,
    /// Bytes and nested replies of the reply under way.
    bytes: usize,
    elements: usize,
    /// Bytes of the line under way already searched for its end: a line
    /// that arrives a byte at a time is scanned once, not once per byte.
    scanned: usize,
}

impl Decoder {
    pub fn new(limits: Limits) -> Decoder {
        Decoder { limits, open: Vec::new(), bytes: 0, elements: 0, scanned: 0 }
    }

    /// The limits of the replies to come (between replies only).
    pub fn set_limits(&mut self, limits: Limits) {
        debug_assert!(!self.in_reply());
        self.limits = limits;
    }

    /// Is a reply under way (part of it taken, the rest to come)?
    pub fn in_reply(&self) -> bool {
        self.bytes > 0
    }

    /// Takes what it can from the front of `buf`: the next whole reply, or
    /// `None` once `buf` holds only part of one (what was taken is removed
    /// from `buf` either way).
    pub fn decode(&mut self, buf: &mut Vec<u8>) -> Result<Option<Reply>, ProtocolError> {
        let mut at = 0;
        let result = self.decode_from(buf, &mut at);
        buf.drain(..at);
        // A large reply's buffer is not kept for the life of the link.
        if buf.capacity() > KEPT_CAPACITY && buf.len() <= KEPT_CAPACITY {
            buf.shrink_to(KEPT_CAPACITY);
        }
        result
    }

    fn decode_from(&mut self, buf: &[u8], at: &mut usize) -> Result<Option<Reply>, ProtocolError> {
        loop {
            let rest = &buf[*at..];
            let Some(line_end) = find_crlf(rest, self.scanned) else {
                if rest.len() > self.limits.line + 2 {
                    return Err(ProtocolError(format!("a line longer than {} bytes", self.limits.line)));
                }
                // The last byte may be the CR of a CRLF still to come.
                self.scanned = rest.len().saturating_sub(1);
                return Ok(None);
            };
            self.scanned = 0;
            let Some((item, used)) = self.item(rest, line_end)? else {
                return Ok(None);
            };
            *at += used;
            self.bytes += used;
            if self.bytes > self.limits.bytes {
                return Err(ProtocolError(format!("a reply longer than {} bytes", self.limits.bytes)));
            }
            let mut reply = match item {
                Item::Whole(reply) => reply,
                Item::Array(n) => {
                    if self.open.len() >= MAX_DEPTH {
                        return Err(ProtocolError("arrays nested too deeply".into()));
                    }
                    self.count(n)?;
                    self.open.push((n, Vec::with_capacity(n.min(1024))));
                    continue;
                }
            };
            // A whole reply: it completes its array, which may complete its
            // own, and so on up.
            loop {
                let Some((left, items)) = self.open.last_mut() else {
                    self.bytes = 0;
                    self.elements = 0;
                    return Ok(Some(reply));
                };
                items.push(reply);
                *left -= 1;
                if *left > 0 {
                    break;
                }
                let (_, items) = self.open.pop().expect("an open array");
                reply = Reply::Array(Some(items));
            }
        }
    }

    fn count(&mut self, n: usize) -> Result<(), ProtocolError> {
        self.elements = self.elements.saturating_add(n);
        if self.elements > self.limits.elements {
            return Err(ProtocolError(format!("a reply of more than {} elements", self.limits.elements)));
        }
        Ok(())
    }

    /// One scalar, or the header of a non-empty array, from the front of
    /// `buf`, whose first line ends at `line_end`; `None` while it is
    /// incomplete (a bulk string's bytes still to come).
    fn item(&self, buf: &[u8], line_end: usize) -> Result<Option<(Item, usize)>, ProtocolError> {
        // (An empty line has no type byte: refused below as 0x0d.)
        let line = buf.get(1..line_end).unwrap_or_default();
        if line.len() > self.limits.line {
            return Err(ProtocolError(format!("a line longer than {} bytes", self.limits.line)));
        }
        let next = line_end + 2;
        let text = || String::from_utf8_lossy(line).into_owned();
        let whole = |reply| Ok(Some((Item::Whole(reply), next)));
        match buf[0] {
            b'+' => whole(Reply::Status(text())),
            b'-' => whole(Reply::Error(text())),
            b':' => whole(Reply::Integer(number(line)?)),
            b'$' => match number(line)? {
                -1 => whole(Reply::Bulk(None)),
                n if n < 0 => Err(ProtocolError(format!("bulk length {n}"))),
                // What is left of the reply's budget: a bulk that cannot fit
                // is refused before any of it is kept.
                n if n as u64 > self.limits.bytes.saturating_sub(self.bytes) as u64 => {
                    Err(ProtocolError(format!(
                        "a bulk string of {n} bytes, more than a reply may be ({} bytes)",
                        self.limits.bytes
                    )))
                }
                n => {
                    let end = next + n as usize;
                    if buf.len() < end + 2 {
                        return Ok(None);
                    }
                    if &buf[end..end + 2] != b"\r\n" {
                        return Err(ProtocolError("bulk string not terminated by CRLF".into()));
                    }
                    Ok(Some((Item::Whole(Reply::Bulk(Some(buf[next..end].to_vec()))), end + 2)))
                }
            },
            b'*' => match number(line)? {
                -1 => whole(Reply::Array(None)),
                0 => whole(Reply::Array(Some(Vec::new()))),
                n if n < 0 => Err(ProtocolError(format!("array length {n}"))),
                n if n as u64 > self.limits.elements as u64 => Err(ProtocolError(format!(
                    "an array of {n} elements, more than a reply may have ({})",
                    self.limits.elements
                ))),
                n => Ok(Some((Item::Array(n as usize), next))),
            },
            other => Err(ProtocolError(format!("unexpected reply type byte 0x{other:02x}"))),
        }
    }
}

/// What one step of decoding found.
enum Item {
    Whole(Reply),
    /// The header of an array of this many elements, which follow.
    Array(usize),
}

/// Where the first CRLF of `buf` is, searching from `from`.
fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?.windows(2).position(|w| w == b"\r\n").map(|p| from + p)
}

fn number(line: &[u8]) -> Result<i64, ProtocolError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ProtocolError(format!("not a number: {:?}", String::from_utf8_lossy(line))))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Limits = Limits { bytes: 1000, elements: 20, line: 100 };

    /// Every reply in `input`, decoded with `limits`, fed `step` bytes at a time.
    fn decode_all(input: &[u8], limits: Limits, step: usize) -> Result<Vec<Reply>, ProtocolError> {
        let mut decoder = Decoder::new(limits);
        let mut buf = Vec::new();
        let mut replies = Vec::new();
        for chunk in input.chunks(step.max(1)) {
            buf.extend_from_slice(chunk);
            while let Some(reply) = decoder.decode(&mut buf)? {
                replies.push(reply);
            }
        }
        assert!(buf.len() <= limits.bytes + step, "kept {} bytes", buf.len());
        Ok(replies)
    }

    fn whole(input: &[u8]) -> Reply {
        let mut replies = decode_all(input, Limits::REPORTS, input.len()).unwrap();
        assert_eq!(replies.len(), 1, "one reply in {input:?}");
        replies.remove(0)
    }

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        command(&mut out, &["AUTH", "user", "p w"]);
        assert_eq!(out, b"*3\r\n$4\r\nAUTH\r\n$4\r\nuser\r\n$3\r\np w\r\n");
        out.clear();
        command_with_values(&mut out, "LPUSH", "q", &["a", "bc"]);
        assert_eq!(out, b"*4\r\n$5\r\nLPUSH\r\n$1\r\nq\r\n$1\r\na\r\n$2\r\nbc\r\n");
        assert_eq!(bulk_len(2), b"$2\r\nbc\r\n".len());
        assert_eq!(bulk_len(12345), 12345 + 10);
    }

    #[test]
    fn every_reply_type_decodes() {
        assert_eq!(whole(b"+OK\r\n"), Reply::Status("OK".into()));
        assert_eq!(whole(b"-OOM command not allowed\r\n"), Reply::Error("OOM command not allowed".into()));
        assert_eq!(whole(b":-7\r\n"), Reply::Integer(-7));
        assert_eq!(whole(b"$5\r\nhe\r\nl\r\n"), Reply::Bulk(Some(b"he\r\nl".to_vec())));
        assert_eq!(whole(b"$-1\r\n"), Reply::Bulk(None));
        assert_eq!(whole(b"*-1\r\n"), Reply::Array(None));
        assert_eq!(whole(b"*0\r\n"), Reply::Array(Some(vec![])));
        assert_eq!(
            whole(b"*2\r\n$9\r\n127.0.0.1\r\n*1\r\n:6379\r\n"),
            Reply::Array(Some(vec![
                Reply::Bulk(Some(b"127.0.0.1".to_vec())),
                Reply::Array(Some(vec![Reply::Integer(6379)]))
            ]))
        );
    }

    const SAMPLE: &[u8] = b"*3\r\n:1\r\n$3\r\nabc\r\n*2\r\n+OK\r\n*0\r\n-ERR x\r\n:2\r\n$-1\r\n";

    #[test]
    fn any_split_gives_the_same_replies() {
        let expected = decode_all(SAMPLE, SMALL, SAMPLE.len()).unwrap();
        assert_eq!(expected.len(), 4);
        for step in 1..SAMPLE.len() {
            assert_eq!(decode_all(SAMPLE, SMALL, step).unwrap(), expected, "step {step}");
        }
        for cut in 0..SAMPLE.len() {
            let mut decoder = Decoder::new(SMALL);
            let (mut first, mut rest) = (SAMPLE[..cut].to_vec(), SAMPLE[cut..].to_vec());
            let mut replies = Vec::new();
            while let Some(r) = decoder.decode(&mut first).unwrap() {
                replies.push(r);
            }
            first.append(&mut rest);
            while let Some(r) = decoder.decode(&mut first).unwrap() {
                replies.push(r);
            }
            assert_eq!(replies, expected, "cut at {cut}");
        }
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        for bad in [&b"hello\r\n"[..], b":x\r\n", b"$3\r\nabcXY", b"$-5\r\n", b"*-2\r\n"] {
            assert!(decode_all(bad, SMALL, 100).is_err(), "{bad:?}");
        }
        let deep = "*1\r\n".repeat(20) + ":1\r\n";
        assert!(decode_all(deep.as_bytes(), SMALL, 100).is_err());
    }

    #[test]
    fn what_exceeds_the_limits_is_refused_from_its_header() {
        // A bulk or an array that says it is huge: refused before any of it.
        let refused = |input: &[u8]| {
            let mut decoder = Decoder::new(SMALL);
            let mut buf = input.to_vec();
            decoder.decode(&mut buf).unwrap_err()
        };
        assert!(refused(b"$4000000000\r\n").0.contains("4000000000"));
        assert!(refused(b"*4000000000\r\n").0.contains("4000000000"));
        assert!(refused(b"$9223372036854775807\r\n").0.contains("bytes"));
        // Many elements in nested arrays, each small.
        let nested = "*2\r\n".to_string() + &("*15\r\n".to_string() + &":1\r\n".repeat(15)).repeat(2);
        assert!(decode_all(nested.as_bytes(), SMALL, 7).unwrap_err().0.contains("elements"));
        // A second bulk that cannot fit what is left of the reply: refused
        // from its header, before its bytes come.
        let mut decoder = Decoder::new(SMALL);
        let mut buf = format!("*2\r\n$600\r\n{}\r\n$600\r\n", "x".repeat(600)).into_bytes();
        assert!(decoder.decode(&mut buf).unwrap_err().0.contains("600 bytes"));
        // Many small bulks adding up.
        let big = "*19\r\n".to_string() + &format!("$60\r\n{}\r\n", "x".repeat(60)).repeat(19);
        let err = decode_all(big.as_bytes(), SMALL, 13).unwrap_err().0;
        assert!(err.contains("more than a reply may be (1000 bytes)"), "{err}");
        // A line that never ends.
        assert!(decode_all(&[b'+'; 500], SMALL, 50).unwrap_err().0.contains("line"));
    }

    /// A small deterministic generator (xorshift), for the random inputs.
    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn random_bytes_never_panic_and_never_keep_more_than_the_limit() {
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        let alphabet = b"+-:$*\r\n0123456789-abc";
        for _ in 0..20_000 {
            let len = random.below(200);
            let input: Vec<u8> = (0..len)
                .map(|_| {
                    if random.below(4) == 0 {
                        random.next() as u8
                    } else {
                        alphabet[random.below(alphabet.len())]
                    }
                })
                .collect();
            let step = 1 + random.below(17);
            let _ = decode_all(&input, SMALL, step);
        }
    }

    #[test]
    fn random_valid_replies_decode_at_any_split() {
        fn reply(random: &mut Random, depth: usize, out: &mut Vec<u8>) {
            match random.below(if depth > 2 { 5 } else { 6 }) {
                0 => out.extend_from_slice(b"+OK\r\n"),
                1 => out.extend_from_slice(b"-ERR no\r\n"),
                2 => out.extend_from_slice(format!(":{}\r\n", random.next() as i32).as_bytes()),
                3 => {
                    let n = random.below(8);
                    out.extend_from_slice(format!("${n}\r\n").as_bytes());
                    out.extend((0..n).map(|_| random.next() as u8));
                    out.extend_from_slice(b"\r\n");
                }
                4 => out.extend_from_slice(b"$-1\r\n"),
                _ => {
                    let n = random.below(4);
                    out.extend_from_slice(format!("*{n}\r\n").as_bytes());
                    for _ in 0..n {
                        reply(random, depth + 1, out);
                    }
                }
            }
        }
        let mut random = Random(42);
        for _ in 0..2_000 {
            let mut input = Vec::new();
            let count = 1 + random.below(4);
            for _ in 0..count {
                reply(&mut random, 0, &mut input);
            }
            let expected = decode_all(&input, Limits::REPORTS, input.len()).unwrap();
            assert_eq!(expected.len(), count);
            let step = 1 + random.below(9);
            assert_eq!(decode_all(&input, Limits::REPORTS, step).unwrap(), expected);
        }
    }
}
