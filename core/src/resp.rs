//! RESP2, the Redis wire protocol: commands out, replies in.
//!
//! Replies are parsed from a buffer that may hold less than a whole reply;
//! [`parse`] then answers `Ok(None)` and the caller reads more. Nothing here
//! touches a socket, so every case is a plain unit test.

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

/// Parses one reply from the front of `buf`: `Ok(Some((reply, bytes used)))`,
/// or `Ok(None)` when `buf` holds only part of it.
pub fn parse(buf: &[u8]) -> Result<Option<(Reply, usize)>, ProtocolError> {
    parse_at(buf, 0, 0)
}

fn parse_at(buf: &[u8], start: usize, depth: usize) -> Result<Option<(Reply, usize)>, ProtocolError> {
    if depth > MAX_DEPTH {
        return Err(ProtocolError("arrays nested too deeply".into()));
    }
    let Some(line_end) = find_crlf(buf, start) else {
        return Ok(None);
    };
    let Some(&kind) = buf.get(start) else {
        return Ok(None);
    };
    let line = &buf[start + 1..line_end];
    let next = line_end + 2;
    let text = || String::from_utf8_lossy(line).into_owned();
    let reply = match kind {
        b'+' => (Reply::Status(text()), next),
        b'-' => (Reply::Error(text()), next),
        b':' => (Reply::Integer(number(line)?), next),
        b'$' => match number(line)? {
            -1 => (Reply::Bulk(None), next),
            n if n < 0 => return Err(ProtocolError(format!("bulk length {n}"))),
            n => {
                let end = next + n as usize;
                if buf.len() < end + 2 {
                    return Ok(None);
                }
                if &buf[end..end + 2] != b"\r\n" {
                    return Err(ProtocolError("bulk string not terminated by CRLF".into()));
                }
                (Reply::Bulk(Some(buf[next..end].to_vec())), end + 2)
            }
        },
        b'*' => match number(line)? {
            -1 => (Reply::Array(None), next),
            n if n < 0 => return Err(ProtocolError(format!("array length {n}"))),
            n => {
                let mut items = Vec::with_capacity((n as usize).min(1024));
                let mut at = next;
                for _ in 0..n {
                    let Some((item, used)) = parse_at(buf, at, depth + 1)? else {
                        return Ok(None);
                    };
                    items.push(item);
                    at += used;
                }
                (Reply::Array(Some(items)), at)
            }
        },
        other => return Err(ProtocolError(format!("unexpected reply type byte 0x{other:02x}"))),
    };
    Ok(Some((reply.0, reply.1 - start)))
}

fn find_crlf(buf: &[u8], start: usize) -> Option<usize> {
    buf.get(start..)?.windows(2).position(|w| w == b"\r\n").map(|p| start + p)
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

    fn whole(input: &[u8]) -> Reply {
        let (reply, used) = parse(input).unwrap().expect("a whole reply");
        assert_eq!(used, input.len());
        reply
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
    fn every_reply_type_parses() {
        assert_eq!(whole(b"+OK\r\n"), Reply::Status("OK".into()));
        assert_eq!(whole(b"-OOM command not allowed\r\n"), Reply::Error("OOM command not allowed".into()));
        assert_eq!(whole(b":-7\r\n"), Reply::Integer(-7));
        assert_eq!(whole(b"$5\r\nhe\r\nl\r\n"), Reply::Bulk(Some(b"he\r\nl".to_vec())));
        assert_eq!(whole(b"$-1\r\n"), Reply::Bulk(None));
        assert_eq!(whole(b"*-1\r\n"), Reply::Array(None));
        assert_eq!(
            whole(b"*2\r\n$9\r\n127.0.0.1\r\n*1\r\n:6379\r\n"),
            Reply::Array(Some(vec![
                Reply::Bulk(Some(b"127.0.0.1".to_vec())),
                Reply::Array(Some(vec![Reply::Integer(6379)]))
            ]))
        );
    }

    #[test]
    fn a_partial_reply_asks_for_more_at_every_cut() {
        let input = b"*3\r\n:1\r\n$3\r\nabc\r\n+OK\r\n";
        for cut in 0..input.len() {
            assert_eq!(parse(&input[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert!(parse(input).unwrap().is_some());
    }

    #[test]
    fn replies_follow_each_other() {
        let input = b":1\r\n:2\r\n";
        let (first, used) = parse(input).unwrap().unwrap();
        assert_eq!((first, used), (Reply::Integer(1), 4));
        assert_eq!(parse(&input[used..]).unwrap().unwrap().0, Reply::Integer(2));
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        assert!(parse(b"hello\r\n").is_err());
        assert!(parse(b":x\r\n").is_err());
        assert!(parse(b"$3\r\nabcXY").is_err());
        assert!(parse(b"$-5\r\n").is_err());
        let deep = "*1\r\n".repeat(20) + ":1\r\n";
        assert!(parse(deep.as_bytes()).is_err());
    }
}
