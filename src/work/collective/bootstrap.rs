//! The bootstrap of a communicator whose ranks run in processes of their own, on one host or
//! several: a unique id that travels as bytes, a rendezvous that hands it to every rank, and the
//! launcher conventions that say who is who.
//!
//! A communicator across processes is made in two steps, as NCCL makes one. Rank 0 makes a
//! [`UniqueId`] ([`UniqueId::new`], `ncclGetUniqueId`), every other rank receives it, and then
//! each rank joins with its own rank number. The module gives three ways to hand the id over:
//!
//! - [`Rendezvous`]: a small TCP exchange. Rank 0 listens, the others connect, each says who it
//!   is (rank, world size, job), and rank 0 answers every one with the id once all have
//!   arrived, or refuses a greeting that is wrong. Everything has a deadline.
//! - [`Launch::from_env`]: the variables a launcher sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `MASTER_ADDR`, `MASTER_PORT`, as `torchrun` sets them), which name the rendezvous.
//! - Your own exchange (MPI, a job scheduler's key-value store): [`UniqueId::to_bytes`] and
//!   [`UniqueId::from_bytes`] are all it needs.
//!
//! # Trust
//! The rendezvous trusts its network, as PyTorch's store does. Anyone who can reach the port
//! can claim a rank, and reads the id (which names rank 0's NCCL bootstrap address). So rank 0
//! binds to the loopback address unless told another, and a job across hosts belongs on a
//! network that only its hosts reach.

use crate::core::engine::CudaEngine;
use crate::driver::collective::UNIQUE_ID_BYTES;
use crate::error::{BootstrapError, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The mark that opens a unique id's bytes.
const ID_MAGIC: &[u8; 8] = b"CUFERRY\x01";

/// The unique id's format version.
const ID_FORMAT: u16 = 1;

/// The unique id's length in bytes: mark, format, library version, the id.
const ID_LEN: usize = ID_MAGIC.len() + 2 + 4 + UNIQUE_ID_BYTES;

/// The id of a communicator whose ranks join it one by one (NCCL's `ncclUniqueId`), with the
/// version of the library that made it.
///
/// It travels as bytes ([`to_bytes`](Self::to_bytes), [`from_bytes`](Self::from_bytes)),
/// stamped with this crate's format and the library's version, so that bytes of another kind,
/// cut short or made by another version of NCCL are refused rather than handed to NCCL.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    library: u32,
    bytes: [u8; UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UniqueId")
            .field("library", &self.library)
            .finish_non_exhaustive()
    }
}

impl UniqueId {
    /// A fresh id, made by the collective library of `engine`'s device (`ncclGetUniqueId`): rank
    /// 0 makes it, and hands it to the others.
    ///
    /// # Errors
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) without NCCL,
    /// [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when it refuses.
    pub fn new(engine: &CudaEngine) -> Result<UniqueId> {
        let (library, bytes) = engine.shared.lock().driver.unique_id()?;
        Ok(UniqueId { library, bytes })
    }

    /// The id as bytes, for an exchange of your own.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ID_LEN);
        out.extend_from_slice(ID_MAGIC);
        out.extend_from_slice(&ID_FORMAT.to_le_bytes());
        out.extend_from_slice(&self.library.to_le_bytes());
        out.extend_from_slice(&self.bytes);
        out
    }

    /// The id `bytes` hold, as [`to_bytes`](Self::to_bytes) wrote it.
    ///
    /// # Errors
    /// [`BootstrapError::UniqueId`] for bytes of another length, without the mark, of another
    /// format version.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let bad = |reason: String| BootstrapError::UniqueId { reason }.into();
        if bytes.len() != ID_LEN {
            return Err(bad(format!(
                "{} bytes, where an id is {ID_LEN}",
                bytes.len()
            )));
        }
        if &bytes[..8] != ID_MAGIC {
            return Err(bad("the bytes do not start with the id's mark".into()));
        }
        let format = u16::from_le_bytes([bytes[8], bytes[9]]);
        if format != ID_FORMAT {
            return Err(bad(format!(
                "format version {format}, where this crate reads {ID_FORMAT}"
            )));
        }
        let library = u32::from_le_bytes(bytes[10..14].try_into().expect("four bytes"));
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id.copy_from_slice(&bytes[14..]);
        Ok(UniqueId { library, bytes: id })
    }

    /// The id's bytes, as the collective library made them.
    pub(crate) fn raw(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.bytes
    }

    /// The version of the collective library that made the id (NCCL's version code,
    /// `major * 10000 + minor * 100 + patch`; 0 for the simulated device).
    pub fn library_version(&self) -> u32 {
        self.library
    }
}

/// Where a process stands in its job, as a launcher says: its rank, the world's size, its rank
/// on its host, and where rank 0's rendezvous listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// How many ranks the job has.
    pub world: usize,
    /// This process's rank among those of its host: the GPU it opens.
    pub local_rank: usize,
    /// Rank 0's host (`MASTER_ADDR`).
    pub host: String,
    /// Rank 0's rendezvous port (`MASTER_PORT`).
    pub port: u16,
}

impl Launch {
    /// Reads the launcher's variables, as `torchrun` sets them: `RANK`, `WORLD_SIZE` and
    /// `MASTER_PORT` must be set; `LOCAL_RANK` defaults to `RANK`, and `MASTER_ADDR` to the
    /// loopback address (`127.0.0.1`).
    ///
    /// # Errors
    /// [`BootstrapError::Environment`] for a missing variable or one that is not a number of
    /// its range; [`BootstrapError::Rank`] for a rank at or above the world size.
    pub fn from_env() -> Result<Launch> {
        Launch::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading each variable through `var`.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Launch> {
        fn number<T: std::str::FromStr>(
            variable: &'static str,
            value: Option<String>,
        ) -> std::result::Result<T, BootstrapError> {
            let Some(value) = value else {
                return Err(BootstrapError::Environment {
                    variable,
                    value: None,
                    reason: "not set",
                });
            };
            value
                .trim()
                .parse()
                .map_err(|_| BootstrapError::Environment {
                    variable,
                    value: Some(value),
                    reason: "not a number of its range",
                })
        }
        let rank: usize = number("RANK", var("RANK"))?;
        let world: usize = number("WORLD_SIZE", var("WORLD_SIZE"))?;
        if world == 0 || rank >= world {
            return Err(BootstrapError::Rank { rank, world }.into());
        }
        let local_rank = match var("LOCAL_RANK") {
            Some(v) => number("LOCAL_RANK", Some(v))?,
            None => rank,
        };
        let port: u16 = number("MASTER_PORT", var("MASTER_PORT"))?;
        let host = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        if host.trim().is_empty() {
            return Err(BootstrapError::Environment {
                variable: "MASTER_ADDR",
                value: Some(host),
                reason: "empty",
            }
            .into());
        }
        Ok(Launch {
            rank,
            world,
            local_rank,
            host,
            port,
        })
    }

    /// The rendezvous these variables name, with its defaults.
    ///
    /// # Errors
    /// [`BootstrapError::Io`] when `MASTER_ADDR` does not resolve.
    pub fn rendezvous(&self) -> Result<Rendezvous> {
        Rendezvous::new((self.host.as_str(), self.port), self.rank, self.world)
    }
}

/// The default deadline of a rendezvous: long enough for every rank of a large job to start.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// The rendezvous protocol's mark, which opens every message (its last byte is the protocol's
/// version).
const WIRE_MAGIC: &[u8; 8] = b"CFRDZV\x00\x01";

/// The largest message body the rendezvous reads.
const WIRE_MAX: usize = 4096;

/// A greeting: rank, world size, job.
const HELLO: u8 = 1;
/// Rank 0's answer to a good greeting: the unique id.
const WELCOME: u8 = 2;
/// Rank 0's answer to a wrong greeting: why.
const REFUSE: u8 = 3;

/// A TCP rendezvous that hands rank 0's [`UniqueId`] to every rank.
///
/// Rank 0 listens at the address; every other rank connects (retrying until rank 0 is up),
/// greets it with its rank, the world's size and the job's name, and waits for the id. Rank 0
/// answers once every rank has arrived. It refuses a greeting of another world size, another
/// job, a rank out of range or already taken, or bytes that are not the protocol, and tells the
/// peer why. Everything waits at most the rendezvous's timeout
/// ([`DEFAULT_RENDEZVOUS_TIMEOUT`] unless set), after which each rank has a typed error saying
/// who was missing.
///
/// The rendezvous trusts its network (see the [module](self)'s docs).
#[derive(Clone, Debug)]
pub struct Rendezvous {
    address: SocketAddr,
    rank: usize,
    world: usize,
    job: String,
    timeout: Duration,
}

impl Rendezvous {
    /// The rendezvous at `address` (rank 0's: where it listens, and where the others connect),
    /// for `rank` of a world of `world`. The job's name is empty until [`job`](Self::job) sets
    /// it.
    ///
    /// # Errors
    /// [`BootstrapError::Rank`] for a rank at or above the world size, or a world of none;
    /// [`BootstrapError::Io`] when the address does not resolve.
    pub fn new(address: impl ToSocketAddrs, rank: usize, world: usize) -> Result<Rendezvous> {
        if world == 0 || rank >= world {
            return Err(BootstrapError::Rank { rank, world }.into());
        }
        let unresolved = |source| BootstrapError::Io {
            address: "the given address".into(),
            operation: "resolve",
            source,
        };
        let address = address
            .to_socket_addrs()
            .map_err(unresolved)?
            .next()
            .ok_or_else(|| unresolved(std::io::ErrorKind::NotFound.into()))?;
        Ok(Rendezvous {
            address,
            rank,
            world,
            job: String::new(),
            timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
        })
    }

    /// The rendezvous the launcher's variables name ([`Launch::from_env`]).
    ///
    /// # Errors
    /// As [`Launch::from_env`] and [`new`](Self::new).
    pub fn from_env() -> Result<Rendezvous> {
        Launch::from_env()?.rendezvous()
    }

    /// Names the job: a rank that greets rank 0 with another name is refused, so two jobs that
    /// share a port by mistake do not join each other.
    pub fn job(mut self, job: impl Into<String>) -> Rendezvous {
        self.job = job.into();
        self
    }

    /// How long the rendezvous waits in all: rank 0 for every rank, the others for rank 0.
    pub fn timeout(mut self, timeout: Duration) -> Rendezvous {
        self.timeout = timeout;
        self
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The world's size.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Hands the id to every rank: rank 0 makes it with `make` and serves it, the others
    /// receive it. Every rank returns the same id.
    ///
    /// # Errors
    /// On rank 0, [`BootstrapError::Io`] when it cannot listen at the address and
    /// [`BootstrapError::Missing`] when not every rank arrives in time (with the connections
    /// it refused meanwhile); `make`'s error. On the others, [`BootstrapError::NoRoot`] when
    /// rank 0 does not answer in time, [`BootstrapError::Refused`] with rank 0's reason,
    /// [`BootstrapError::Garbage`] for an answer that is not the protocol, and
    /// [`BootstrapError::UniqueId`] for an id this process cannot use.
    pub fn exchange(&self, make: impl FnOnce() -> Result<UniqueId>) -> Result<UniqueId> {
        let deadline = Instant::now() + self.timeout;
        if self.rank == 0 {
            self.serve(make, deadline)
        } else {
            self.join(deadline)
        }
    }

    fn address(&self) -> String {
        self.address.to_string()
    }

    fn io(&self, operation: &'static str) -> impl FnOnce(std::io::Error) -> BootstrapError {
        let address = self.address();
        move |source| BootstrapError::Io {
            address,
            operation,
            source,
        }
    }

    /// Rank 0: listens, takes every rank's greeting, then answers each with the id.
    fn serve(
        &self,
        make: impl FnOnce() -> Result<UniqueId>,
        deadline: Instant,
    ) -> Result<UniqueId> {
        if self.world == 1 {
            return make(); // a world of one: no one to tell
        }
        let listener = TcpListener::bind(self.address).map_err(self.io("bind"))?;
        listener.set_nonblocking(true).map_err(self.io("listen"))?;
        let mut peers: Vec<Option<TcpStream>> = (0..self.world).map(|_| None).collect();
        let mut refused = Vec::new();
        let mut arrived = 1;
        while arrived < self.world {
            let now = Instant::now();
            if now >= deadline {
                let missing = (1..self.world).filter(|&r| peers[r].is_none()).collect();
                return Err(BootstrapError::Missing {
                    address: self.address(),
                    missing,
                    refused,
                }
                .into());
            }
            let (mut stream, peer) = match listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.io("accept")(e).into()),
            };
            // A greeting must come within a second (or what is left of the deadline).
            let patience = (deadline - now).min(Duration::from_secs(1));
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_read_timeout(Some(patience.max(Duration::from_millis(1))));
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let reason = match read_message(&mut stream) {
                Ok((HELLO, body)) => match Hello::decode(&body) {
                    Some(hello) => match self.check(&hello, &peers) {
                        Ok(()) => {
                            peers[hello.rank] = Some(stream);
                            arrived += 1;
                            continue;
                        }
                        Err(reason) => {
                            let _ = write_message(&mut stream, REFUSE, reason.as_bytes());
                            reason
                        }
                    },
                    None => "a greeting that does not decode".into(),
                },
                Ok((kind, _)) => format!("a message of kind {kind} where a greeting belongs"),
                Err(reason) => reason,
            };
            refused.push(format!("{peer}: {reason}"));
        }
        let id = make()?;
        let bytes = id.to_bytes();
        for stream in peers.iter_mut().flatten() {
            write_message(stream, WELCOME, &bytes).map_err(self.io("write"))?;
        }
        Ok(id)
    }

    /// Why rank 0 refuses `hello`, if it does.
    fn check(&self, hello: &Hello, peers: &[Option<TcpStream>]) -> std::result::Result<(), String> {
        if hello.job != self.job {
            return Err(format!(
                "a peer of job {:?}, where this is job {:?}",
                hello.job, self.job
            ));
        }
        if hello.world != self.world {
            return Err(format!(
                "a world of {} ranks, where rank 0's has {}",
                hello.world, self.world
            ));
        }
        if hello.rank == 0 || hello.rank >= self.world {
            return Err(format!(
                "rank {}, where the others are 1 to {}",
                hello.rank,
                self.world - 1
            ));
        }
        if peers[hello.rank].is_some() {
            return Err(format!("rank {} arrived already", hello.rank));
        }
        Ok(())
    }

    /// A rank other than 0: connects (retrying until rank 0 listens), greets, and waits for the
    /// id.
    fn join(&self, deadline: Instant) -> Result<UniqueId> {
        let mut last: Option<String> = None;
        let no_root = |last: Option<String>| BootstrapError::NoRoot {
            address: self.address(),
            last,
        };
        let mut stream = loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(no_root(last).into());
            }
            match TcpStream::connect_timeout(&self.address, deadline - now) {
                Ok(stream) => break stream,
                Err(e) => {
                    last = Some(e.to_string());
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        let hello = Hello {
            rank: self.rank,
            world: self.world,
            job: self.job.clone(),
        };
        let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
        write_message(&mut stream, HELLO, &hello.encode()).map_err(self.io("write"))?;
        let left = deadline.saturating_duration_since(Instant::now());
        let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        match read_message(&mut stream) {
            Ok((WELCOME, body)) => UniqueId::from_bytes(&body),
            Ok((REFUSE, body)) => Err(BootstrapError::Refused {
                address: self.address(),
                rank: self.rank,
                reason: String::from_utf8_lossy(&body).into_owned(),
            }
            .into()),
            Ok((kind, _)) => Err(BootstrapError::Garbage {
                address: self.address(),
                reason: format!("a message of kind {kind} where the id belongs"),
            }
            .into()),
            Err(reason) if reason.starts_with("timed out") || reason.starts_with("closed") => {
                Err(no_root(Some(reason)).into())
            }
            Err(reason) => Err(BootstrapError::Garbage {
                address: self.address(),
                reason,
            }
            .into()),
        }
    }
}

/// A rank's greeting.
struct Hello {
    rank: usize,
    world: usize,
    job: String,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.rank as u64).to_le_bytes());
        out.extend_from_slice(&(self.world as u64).to_le_bytes());
        out.extend_from_slice(self.job.as_bytes());
        out
    }

    fn decode(body: &[u8]) -> Option<Hello> {
        if body.len() < 16 {
            return None;
        }
        let rank = usize::try_from(u64::from_le_bytes(body[..8].try_into().ok()?)).ok()?;
        let world = usize::try_from(u64::from_le_bytes(body[8..16].try_into().ok()?)).ok()?;
        let job = String::from_utf8(body[16..].to_vec()).ok()?;
        Some(Hello { rank, world, job })
    }
}

/// Writes one message: the mark, its kind, its length and its body.
fn write_message(stream: &mut TcpStream, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(WIRE_MAGIC.len() + 5 + body.len());
    out.extend_from_slice(WIRE_MAGIC);
    out.push(kind);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    stream.write_all(&out)?;
    stream.flush()
}

/// Reads one message, or says what was wrong with the bytes (or that none came in time).
fn read_message(stream: &mut TcpStream) -> std::result::Result<(u8, Vec<u8>), String> {
    let mut head = [0u8; 13];
    read_exact(stream, &mut head)?;
    if &head[..8] != WIRE_MAGIC {
        if head[..6] == WIRE_MAGIC[..6] {
            return Err(format!(
                "rendezvous protocol version {}, where this crate speaks {}",
                head[7], WIRE_MAGIC[7]
            ));
        }
        return Err("bytes that do not start with the rendezvous mark".into());
    }
    let kind = head[8];
    let len = u32::from_le_bytes(head[9..13].try_into().expect("four bytes")) as usize;
    if len > WIRE_MAX {
        return Err(format!(
            "a message of {len} bytes, above the {WIRE_MAX} allowed"
        ));
    }
    let mut body = vec![0u8; len];
    read_exact(stream, &mut body)?;
    Ok((kind, body))
}

/// `read_exact`, with its failures in words: `timed out`, `closed` or the system's.
fn read_exact(stream: &mut TcpStream, buf: &mut [u8]) -> std::result::Result<(), String> {
    stream.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "timed out".to_owned(),
        std::io::ErrorKind::UnexpectedEof => "closed before a whole message".to_owned(),
        _ => e.to_string(),
    })
}
