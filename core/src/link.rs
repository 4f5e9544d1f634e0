//! One connection to a broker: a non-blocking socket, TLS or not, whose
//! every wait goes through the caller's [`Wait`]. It speaks RESP (Redis)
//! itself; other protocols (AMQP) send and read raw bytes through it.
//!
//! Nothing here blocks. Inside PostgreSQL the `Wait` is the process latch
//! together with the socket (`WaitLatchOrSocket`), so that a signal is
//! answered while the broker is slow; elsewhere it is [`Poll`]. Every
//! operation has one deadline, however many system calls it takes.

use std::io::{self, Read, Write};
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;

use crate::resp::{Decoder, Limits, ProtocolError, Reply};

/// What a wait is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interest {
    Readable,
    Writable,
}

/// The waiter was asked to give up (a signal asked the process to do
/// something else first): the operation is abandoned, its outcome unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted;

/// How a link waits.
pub trait Wait {
    /// Returns when `socket` is ready for its interest (with `None`, when a
    /// short while has passed), at `deadline` at the latest, or earlier for
    /// no reason at all: callers try again and look at the clock.
    fn wait(&mut self, socket: Option<(RawFd, Interest)>, deadline: Instant) -> Result<(), Interrupted>;

    /// Whether the caller must give up now, without waiting: a link whose
    /// peer keeps the socket ready never waits, and asks this between reads.
    fn check(&mut self) -> Result<(), Interrupted> {
        Ok(())
    }

    /// The peer paused the traffic the caller waits on (`Some(why)`: a
    /// RabbitMQ alarm), or lifted the pause (`None`); the wait goes on
    /// meanwhile. The caller may show it.
    fn paused(&mut self, _why: Option<&str>) {}
}

/// A [`Wait`] on poll(2), for programs without a latch (tests, examples).
pub struct Poll;

/// How long a wait without a socket sleeps before the caller looks again.
pub const NAP: Duration = Duration::from_millis(20);

impl Wait for Poll {
    fn wait(&mut self, socket: Option<(RawFd, Interest)>, deadline: Instant) -> Result<(), Interrupted> {
        let left = deadline.saturating_duration_since(Instant::now());
        match socket {
            None => std::thread::sleep(left.min(NAP)),
            Some((fd, interest)) => {
                let events = match interest {
                    Interest::Readable => libc::POLLIN,
                    Interest::Writable => libc::POLLOUT,
                };
                let mut pollfd = libc::pollfd { fd, events, revents: 0 };
                let ms = left.as_millis().min(i32::MAX as u128) as i32;
                // SAFETY: one valid pollfd; EINTR just returns early.
                unsafe { libc::poll(&mut pollfd, 1, ms) };
            }
        }
        Ok(())
    }
}

/// Why a link failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkError {
    /// The deadline passed.
    Timeout,
    Interrupted,
    /// The host name did not resolve.
    Resolve(String),
    /// Connecting, reading or writing failed, or the server hung up.
    Io(String),
    /// The TLS handshake or a TLS record failed.
    Tls(String),
    Protocol(ProtocolError),
}

impl From<Interrupted> for LinkError {
    fn from(_: Interrupted) -> LinkError {
        LinkError::Interrupted
    }
}

pub struct Link {
    socket: TcpStream,
    tls: Option<Box<rustls::ClientConnection>>,
    /// Bytes received and not yet decoded: at most part of one reply (the
    /// decoder takes whole parts as they come) and one read.
    inbox: Vec<u8>,
    decoder: Decoder,
}

/// Read size; replies to pushes are a few bytes each.
const READ_CHUNK: usize = 16 * 1024;

impl Link {
    /// Resolves `host`, connects to the first address that answers and, with
    /// `tls`, completes the handshake, all before `deadline`.
    pub fn connect(
        host: &str,
        port: u16,
        tls: Option<Arc<rustls::ClientConfig>>,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Link, LinkError> {
        let mut last_error = LinkError::Resolve(format!("{host} has no address"));
        for address in resolve(host, port, waiter, deadline)? {
            match connect_socket(address, waiter, deadline) {
                Ok(socket) => {
                    let mut link =
                        Link { socket, tls: None, inbox: Vec::new(), decoder: Decoder::new(Limits::REPLY) };
                    if let Some(config) = tls {
                        link.handshake(config, host, waiter, deadline)?;
                    }
                    return Ok(link);
                }
                Err(e @ (LinkError::Timeout | LinkError::Interrupted)) => return Err(e),
                Err(e) => last_error = e,
            }
        }
        Err(last_error)
    }

    pub fn fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    fn handshake(
        &mut self,
        config: Arc<rustls::ClientConfig>,
        host: &str,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), LinkError> {
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| LinkError::Tls(format!("{host} is not a valid TLS server name: {e}")))?;
        let tls = rustls::ClientConnection::new(config, name).map_err(|e| LinkError::Tls(e.to_string()))?;
        self.tls = Some(Box::new(tls));
        while self.tls.as_ref().is_some_and(|t| t.is_handshaking()) {
            self.exchange_tls(waiter, deadline)?;
        }
        self.flush(waiter, deadline)
    }

    /// One step of TLS traffic: send what is pending, else receive.
    fn exchange_tls(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<(), LinkError> {
        let fd = self.fd();
        let tls = self.tls.as_mut().expect("a TLS link");
        if tls.wants_write() {
            match tls.write_tls(&mut self.socket) {
                Ok(_) => Ok(()),
                Err(e) => would_block(e, fd, Interest::Writable, waiter, deadline),
            }
        } else {
            match tls.read_tls(&mut self.socket) {
                Ok(0) => Err(LinkError::Io("the server closed the connection".into())),
                Ok(_) => tls.process_new_packets().map(drop).map_err(|e| LinkError::Tls(e.to_string())),
                Err(e) => would_block(e, fd, Interest::Readable, waiter, deadline),
            }
        }
    }

    /// Sends all of `data`.
    pub fn send(&mut self, data: &[u8], waiter: &mut dyn Wait, deadline: Instant) -> Result<(), LinkError> {
        let mut sent = 0;
        while sent < data.len() {
            sent += self.send_some(&data[sent..], waiter, deadline)?;
        }
        self.flush(waiter, deadline)
    }

    /// Sends what the socket takes now of `data` (with TLS: what rustls
    /// takes, once the records of what it took before are out), waiting for
    /// the socket, until `deadline` at the latest, only while it takes
    /// nothing; returns how many bytes went. [`Link::flush`] sends the
    /// records of the last of them.
    pub fn send_some(
        &mut self,
        data: &[u8],
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<usize, LinkError> {
        let fd = self.fd();
        loop {
            self.flush(waiter, deadline)?;
            let written = match self.tls.as_mut() {
                // rustls takes plaintext up to its buffer limit; the records
                // go out at the next flush.
                Some(tls) => tls.writer().write(data),
                None => self.socket.write(data),
            };
            match written {
                Ok(n) => return Ok(n),
                Err(e) if self.tls.is_none() => would_block(e, fd, Interest::Writable, waiter, deadline)?,
                Err(e) => return Err(LinkError::Tls(e.to_string())),
            }
        }
    }

    /// Sends the TLS records still pending (nothing to do without TLS).
    pub fn flush(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<(), LinkError> {
        while self.tls.as_ref().is_some_and(|t| t.wants_write()) {
            self.exchange_tls(waiter, deadline)?;
        }
        Ok(())
    }

    /// Receives one reply. Every read looks at the clock and asks the
    /// waiter whether to give up, so that a peer that keeps the socket
    /// readable (streaming, or dripping a byte at a time) is still timed
    /// out and a shutdown still answered.
    pub fn receive(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<Reply, LinkError> {
        loop {
            if let Some(reply) = self.decoder.decode(&mut self.inbox).map_err(LinkError::Protocol)? {
                return Ok(reply);
            }
            if Instant::now() >= deadline {
                return Err(LinkError::Timeout);
            }
            waiter.check()?;
            self.read_more(waiter, deadline)?;
        }
    }

    /// Sends `commands` (already encoded) and receives `replies` replies,
    /// each within [`Limits::REPLY`], no more: bytes left over, or that came
    /// while no command was under way, answer no command of ours, and the
    /// link cannot be trusted.
    pub fn round_trip(
        &mut self,
        commands: &[u8],
        replies: usize,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Vec<Reply>, LinkError> {
        self.round_trip_within(commands, replies, Limits::REPLY, waiter, deadline)
    }

    /// [`Link::round_trip`] with other limits for its replies.
    pub fn round_trip_within(
        &mut self,
        commands: &[u8],
        replies: usize,
        limits: Limits,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Vec<Reply>, LinkError> {
        self.expect_silence()?;
        self.decoder.set_limits(limits);
        self.send(commands, waiter, deadline)?;
        let received = (0..replies).map(|_| self.receive(waiter, deadline)).collect::<Result<Vec<_>, _>>()?;
        if !self.inbox.is_empty() || self.decoder.in_reply() {
            return Err(unasked());
        }
        Ok(received)
    }

    /// Fails if the server sent anything since the last round trip.
    fn expect_silence(&mut self) -> Result<(), LinkError> {
        if !self.inbox.is_empty() {
            return Err(unasked());
        }
        let mut byte = [0u8; 1];
        let peeked = match self.tls.as_mut() {
            Some(tls) => {
                // Records that arrived meanwhile hold plaintext, or a close.
                pull_records(tls, &mut self.socket)?;
                tls.reader().read(&mut byte)
            }
            None => self.socket.peek(&mut byte),
        };
        match peeked {
            Ok(0) => Err(LinkError::Io("the server closed the connection".into())),
            Ok(_) => Err(unasked()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(LinkError::Io(e.to_string())),
        }
    }

    fn read_more(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<(), LinkError> {
        let mut inbox = std::mem::take(&mut self.inbox);
        let read = self.read_some(&mut inbox, waiter, deadline);
        self.inbox = inbox;
        read
    }

    /// Appends to `into` what one read brings, waiting for the socket (to
    /// `deadline` at the latest) when nothing has come yet. A TLS link may
    /// return having read records that held no plaintext.
    pub fn read_some(
        &mut self,
        into: &mut Vec<u8>,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), LinkError> {
        let fd = self.fd();
        match self.read_now(into) {
            Ok(0) => {}
            Ok(_) => return Ok(()),
            Err(e) => return Err(e),
        }
        match self.tls.as_mut() {
            None => would_block(io::ErrorKind::WouldBlock.into(), fd, Interest::Readable, waiter, deadline),
            // No plaintext yet: more records are needed.
            Some(_) => self.exchange_tls(waiter, deadline),
        }
    }

    /// Appends to `into` what has come and not been read, without waiting;
    /// returns how many bytes that was (0: nothing now). A closed
    /// connection is an error.
    pub fn read_now(&mut self, into: &mut Vec<u8>) -> Result<usize, LinkError> {
        let mut chunk = [0u8; READ_CHUNK];
        let read = match self.tls.as_mut() {
            None => self.socket.read(&mut chunk),
            Some(tls) => {
                pull_records(tls, &mut self.socket)?;
                match tls.reader().read(&mut chunk) {
                    Ok(0) => return Err(LinkError::Io("the server closed the TLS session".into())),
                    other => other,
                }
            }
        };
        match read {
            Ok(0) => Err(LinkError::Io("the server closed the connection".into())),
            Ok(n) => {
                into.extend_from_slice(&chunk[..n]);
                Ok(n)
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(0),
            Err(e) => Err(LinkError::Io(e.to_string())),
        }
    }
}

/// Reads and decrypts the TLS records that have come, without waiting.
fn pull_records(tls: &mut rustls::ClientConnection, socket: &mut TcpStream) -> Result<(), LinkError> {
    match tls.read_tls(socket) {
        Ok(0) => Err(LinkError::Io("the server closed the TLS session".into())),
        Ok(_) => tls.process_new_packets().map(drop).map_err(|e| LinkError::Tls(e.to_string())),
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(()),
        Err(e) => Err(LinkError::Io(e.to_string())),
    }
}

fn unasked() -> LinkError {
    LinkError::Protocol(ProtocolError("the server sent a reply no command asked for".into()))
}

/// A non-blocking call that could not proceed: wait for the socket (or fail
/// at the deadline). Any other error ends the link.
fn would_block(
    e: io::Error,
    fd: RawFd,
    interest: Interest,
    waiter: &mut dyn Wait,
    deadline: Instant,
) -> Result<(), LinkError> {
    match e.kind() {
        io::ErrorKind::WouldBlock => {
            if Instant::now() >= deadline {
                return Err(LinkError::Timeout);
            }
            waiter.wait(Some((fd, interest)), deadline)?;
            Ok(())
        }
        io::ErrorKind::Interrupted => Ok(()),
        _ => Err(LinkError::Io(e.to_string())),
    }
}

/// The addresses of `host`. An IP address is used as it is; a name is
/// resolved on a helper thread (getaddrinfo cannot be interrupted) while the
/// caller keeps waiting on its own terms.
fn resolve(
    host: &str,
    port: u16,
    waiter: &mut dyn Wait,
    deadline: Instant,
) -> Result<Vec<SocketAddr>, LinkError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let (sender, receiver) = mpsc::channel();
    let name = host.to_string();
    spawn_without_signals(move || {
        let _ = sender.send((name.as_str(), port).to_socket_addrs().map(Vec::from_iter));
    })
    .map_err(|e| LinkError::Resolve(format!("cannot start the resolver thread: {e}")))?;
    loop {
        match receiver.try_recv() {
            Ok(Ok(addresses)) => return Ok(addresses),
            Ok(Err(e)) => return Err(LinkError::Resolve(format!("cannot resolve {host}: {e}"))),
            Err(mpsc::TryRecvError::Disconnected) => {
                return Err(LinkError::Resolve(format!("cannot resolve {host}")));
            }
            Err(mpsc::TryRecvError::Empty) if Instant::now() >= deadline => return Err(LinkError::Timeout),
            Err(mpsc::TryRecvError::Empty) => waiter.wait(None, deadline)?,
        }
    }
}

/// Spawns a thread with every signal blocked, so that the process's signal
/// handlers keep running on the thread that owns them. The caller's mask is
/// changed only for the moment the thread is created.
fn spawn_without_signals(body: impl FnOnce() + Send + 'static) -> io::Result<()> {
    // SAFETY: plain signal-mask manipulation around thread creation.
    unsafe {
        let mut all = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigfillset(all.as_mut_ptr());
        let mut previous = MaybeUninit::<libc::sigset_t>::uninit();
        libc::pthread_sigmask(libc::SIG_BLOCK, all.as_ptr(), previous.as_mut_ptr());
        let spawned = std::thread::Builder::new().name("outbox-resolve".into()).spawn(body);
        libc::pthread_sigmask(libc::SIG_SETMASK, previous.as_ptr(), std::ptr::null_mut());
        spawned.map(drop)
    }
}

/// A non-blocking TCP connection to `address`, established before `deadline`.
fn connect_socket(
    address: SocketAddr,
    waiter: &mut dyn Wait,
    deadline: Instant,
) -> Result<TcpStream, LinkError> {
    let io_error = |what: &str| LinkError::Io(format!("{what} {address}: {}", io::Error::last_os_error()));
    let family = if address.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: a new socket, owned by the TcpStream from here on.
    let socket = unsafe {
        let fd = libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io_error("cannot create a socket for"));
        }
        TcpStream::from_raw_fd(fd)
    };
    socket.set_nodelay(true).map_err(|e| LinkError::Io(e.to_string()))?;
    let (storage, length) = socket_address(address);
    // SAFETY: storage holds a sockaddr of `length` bytes.
    let started = unsafe { libc::connect(socket.as_raw_fd(), (&raw const storage).cast(), length) };
    if started != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINPROGRESS) {
        return Err(io_error("cannot connect to"));
    }
    loop {
        // Connected, refused or still under way: SO_ERROR and the peer tell.
        if socket.peer_addr().is_ok() {
            return Ok(socket);
        }
        if let Ok(Some(e)) = socket.take_error() {
            return Err(LinkError::Io(format!("cannot connect to {address}: {e}")));
        }
        if Instant::now() >= deadline {
            return Err(LinkError::Timeout);
        }
        waiter.wait(Some((socket.as_raw_fd(), Interest::Writable)), deadline)?;
    }
}

fn socket_address(address: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is valid; the family's own
    // structure is written over its start.
    unsafe {
        let mut storage: libc::sockaddr_storage = std::mem::zeroed();
        let length = match address {
            SocketAddr::V4(a) => {
                let sin = (&raw mut storage).cast::<libc::sockaddr_in>();
                (*sin).sin_family = libc::AF_INET as libc::sa_family_t;
                (*sin).sin_port = a.port().to_be();
                (*sin).sin_addr = libc::in_addr { s_addr: u32::from(*a.ip()).to_be() };
                size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(a) => {
                let sin6 = (&raw mut storage).cast::<libc::sockaddr_in6>();
                (*sin6).sin6_family = libc::AF_INET6 as libc::sa_family_t;
                (*sin6).sin6_port = a.port().to_be();
                (*sin6).sin6_addr = libc::in6_addr { s6_addr: a.ip().octets() };
                (*sin6).sin6_flowinfo = a.flowinfo();
                (*sin6).sin6_scope_id = a.scope_id();
                size_of::<libc::sockaddr_in6>()
            }
        };
        (storage, length as libc::socklen_t)
    }
}
