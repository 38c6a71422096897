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
//!
//! What it checks, whoever is on the network: every launcher variable against its range
//! ([`Launch::from_vars`]); every field of every message (mark, version, kind, length, rank,
//! world, job, id) against a bound before it sizes anything; one deadline for the whole
//! exchange, however slowly a peer trickles its bytes; and strangers cannot keep a world from
//! forming: rank 0 reads every greeting at once, gives each connection
//! [`GREETING_PATIENCE`] to greet, holds at most [`MAX_UNGREETED`] ungreeted connections, and
//! lists at most [`MAX_LISTED_REFUSALS`] refusals (with a count of the rest).

use super::Communicator;
use crate::core::engine::CudaEngine;
use crate::driver::collective::UNIQUE_ID_BYTES;
use crate::error::{Error, IoError, MalformedError, PeerError, Result, SetupError, UsageError};
use crate::sync::deadline::Deadline;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
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
    /// [`MalformedError::UniqueId`] for bytes of another length, without the mark, of another
    /// format version.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let bad = |reason: String| MalformedError::UniqueId { reason }.into();
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

/// The largest world a rendezvous, a join's launcher variables or [`Rendezvous::new`] take:
/// 262,144 ranks (2^18). NCCL numbers ranks with a C `int`, and the largest jobs run are of
/// the order of 10^5 GPUs; the bound keeps rank 0's table of ranks under a MiB, so a
/// `WORLD_SIZE` of 10^15 is a typed [`UsageError::PastBound`], not an allocation that aborts
/// the process.
pub const MAX_WORLD: usize = 1 << 18;

/// The longest job name ([`Rendezvous::job`]) a rendezvous sends or takes, in bytes.
pub const MAX_JOB_BYTES: usize = 256;

/// How long rank 0 gives a connection to send its whole greeting (or what is left of the
/// deadline, if less). A rank greets as soon as it connects; a connection that says nothing,
/// or trickles, is closed when its patience runs out.
pub const GREETING_PATIENCE: Duration = Duration::from_secs(1);

/// The most connections rank 0 holds that have not greeted yet. Past it, a new connection
/// closes the oldest one that has had [`GREETING_GRACE`] to greet (or waits in the listener's
/// queue while none has), so strangers that connect and say nothing cannot keep the ranks out.
/// A rank whose connection rank 0 closes unanswered connects again.
pub const MAX_UNGREETED: usize = 128;

/// How long a connection has to greet before rank 0 may close it to make room for a newer one.
pub const GREETING_GRACE: Duration = Duration::from_millis(50);

/// The most refusals [`PeerError::Missing`] lists; the rest are counted in a last entry.
pub const MAX_LISTED_REFUSALS: usize = 32;

/// The longest host name `MASTER_ADDR` may hold, in bytes (DNS's limit).
const MAX_HOST_BYTES: usize = 253;

/// The longest refusal's reason on the wire, in bytes: longer ones are cut, and an answer that
/// claims more is not the protocol.
const MAX_REASON_BYTES: usize = 1024;

/// A greeting's body: the rank and the world's size (eight bytes each), then the job's name.
const HELLO_FIXED: usize = 16;

/// The longest greeting's body.
const HELLO_MAX: usize = HELLO_FIXED + MAX_JOB_BYTES;

/// A message's head: the mark, the kind, the body's length.
const HEAD: usize = WIRE_MAGIC.len() + 1 + 4;

/// The longest a socket read, write or connect waits before it asks the deadline again.
const IO_SLICE: Duration = Duration::from_secs(1);

/// How long a rank waits between attempts to reach rank 0.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// The most bytes rank 0 reads and discards from a refused connection before closing it (so
/// that the refusal is not lost to a reset).
const DRAIN_BYTES: usize = 64 << 10;

/// How much of a launcher variable's value an error repeats.
const SHOWN_BYTES: usize = 64;

/// Where a process stands in its job, as a launcher says: its rank, the world's size, its rank
/// on its host, and where rank 0's rendezvous listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// How many ranks the job has, `1..=`[`MAX_WORLD`].
    pub world: usize,
    /// This process's rank among those of its host: the GPU it opens, below the world's size
    /// (and below `LOCAL_WORLD_SIZE`, where that is set).
    pub local_rank: usize,
    /// Rank 0's host (`MASTER_ADDR`, trimmed, an IPv6 address without its brackets).
    pub host: String,
    /// Rank 0's rendezvous port (`MASTER_PORT`), never 0.
    pub port: u16,
    /// The job's deadline, where one was set ([`with_timeout`](Self::with_timeout)).
    timeout: Option<Duration>,
}

/// A launcher variable's value as an error repeats it: cut to [`SHOWN_BYTES`], with its
/// length, where it is longer.
fn shown(value: &str) -> String {
    if value.len() <= SHOWN_BYTES {
        return value.to_owned();
    }
    format!("{}... ({} bytes)", cut(value, SHOWN_BYTES), value.len())
}

/// The longest start of `text` of at most `bytes` bytes that ends on a character.
fn cut(text: &str, bytes: usize) -> &str {
    let mut end = bytes.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A launcher variable that is not what it must be.
fn environment(variable: &'static str, value: &str, reason: &'static str) -> Error {
    SetupError::Environment {
        variable,
        value: Some(shown(value)),
        reason,
    }
    .into()
}

/// A launcher variable's number, as a `T`.
fn number<T: std::str::FromStr>(
    variable: &'static str,
    value: Option<String>,
) -> std::result::Result<T, Error> {
    let Some(value) = value else {
        return Err(SetupError::Environment {
            variable,
            value: None,
            reason: "not set",
        }
        .into());
    };
    value
        .trim()
        .parse()
        .map_err(|_| environment(variable, &value, "not a number of its range"))
}

/// `Err` for a world past [`MAX_WORLD`].
fn check_world(what: &'static str, world: usize) -> std::result::Result<(), Error> {
    if world > MAX_WORLD {
        return Err(UsageError::PastBound {
            what,
            value: world.to_string(),
            limit: format!("at most {MAX_WORLD} ranks (MAX_WORLD)"),
        }
        .into());
    }
    Ok(())
}

/// `MASTER_ADDR`'s host, checked for its form: an IP address (an IPv6 one with or without
/// brackets) or a host name of letters, digits, `-` and `_` in dot-separated labels of 1 to 63
/// bytes, at most 253 bytes in all.
fn host(value: Option<String>) -> std::result::Result<String, Error> {
    const VARIABLE: &str = "MASTER_ADDR";
    let Some(raw) = value else {
        return Ok("127.0.0.1".into());
    };
    let bad = |reason| environment(VARIABLE, &raw, reason);
    let host = raw.trim();
    if host.is_empty() {
        return Err(bad("empty"));
    }
    if host.len() > MAX_HOST_BYTES {
        return Err(UsageError::PastBound {
            what: VARIABLE,
            value: format!("a host of {} bytes", raw.len()),
            limit: format!("at most {MAX_HOST_BYTES} bytes"),
        }
        .into());
    }
    if let Some(inner) = host.strip_prefix('[') {
        return match inner.strip_suffix(']').map(str::parse::<Ipv6Addr>) {
            Some(Ok(_)) => Ok(inner[..inner.len() - 1].to_owned()),
            _ => Err(bad("brackets that do not hold an IPv6 address")),
        };
    }
    if host.parse::<IpAddr>().is_ok() {
        return Ok(host.to_owned());
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let label = |l: &str| {
        (1..=63).contains(&l.len())
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if name.split('.').all(label) {
        Ok(host.to_owned())
    } else {
        Err(bad(
            "not an IP address or a host name (labels of letters, digits, '-' and '_')",
        ))
    }
}

impl Launch {
    /// Reads the launcher's variables, as `torchrun` sets them: `RANK`, `WORLD_SIZE` and
    /// `MASTER_PORT` must be set; `LOCAL_RANK` defaults to `RANK`, and `MASTER_ADDR` to the
    /// loopback address (`127.0.0.1`). `LOCAL_WORLD_SIZE`, where set, bounds `LOCAL_RANK`.
    ///
    /// Every value is checked before it is used: the world's size is 1 to [`MAX_WORLD`], the
    /// rank and the local rank below it, `LOCAL_WORLD_SIZE` 1 to the world's size, the port
    /// 1 to 65535, the host an IP address or a host name of at most 253 bytes. An error
    /// repeats at most 64 bytes of a value.
    ///
    /// # Errors
    /// [`SetupError::Environment`] for a missing variable, one that is not a number of its
    /// range, a world of none, port 0 or a host that is not one; [`UsageError::NotARank`] for
    /// a rank at or above the world size; [`UsageError::PastBound`] for a world past
    /// [`MAX_WORLD`], a local rank past its bound or a host name past 253 bytes.
    pub fn from_env() -> Result<Launch> {
        Launch::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading each variable through `var`.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Launch> {
        let rank: usize = number("RANK", var("RANK"))?;
        let world: usize = number("WORLD_SIZE", var("WORLD_SIZE"))?;
        if world == 0 {
            return Err(environment(
                "WORLD_SIZE",
                "0",
                "a world has at least one rank",
            ));
        }
        check_world("WORLD_SIZE", world)?;
        if rank >= world {
            return Err(UsageError::NotARank { rank, world }.into());
        }
        let local_rank: usize = match var("LOCAL_RANK") {
            Some(v) => number("LOCAL_RANK", Some(v))?,
            None => rank,
        };
        let local_limit = |limit: String| UsageError::PastBound {
            what: "LOCAL_RANK",
            value: local_rank.to_string(),
            limit,
        };
        if local_rank >= world {
            return Err(local_limit(format!("below the world's size, {world}")).into());
        }
        if let Some(v) = var("LOCAL_WORLD_SIZE") {
            let local_world: usize = number("LOCAL_WORLD_SIZE", Some(v))?;
            if local_world == 0 || local_world > world {
                return Err(UsageError::PastBound {
                    what: "LOCAL_WORLD_SIZE",
                    value: local_world.to_string(),
                    limit: format!("1 to the world's size, {world}"),
                }
                .into());
            }
            if local_rank >= local_world {
                return Err(local_limit(format!("below LOCAL_WORLD_SIZE, {local_world}")).into());
            }
        }
        let port: u32 = number("MASTER_PORT", var("MASTER_PORT"))?;
        let port = match u16::try_from(port) {
            Ok(port) if port != 0 => port,
            _ => {
                return Err(environment(
                    "MASTER_PORT",
                    &port.to_string(),
                    "not a port a rank can reach (1 to 65535)",
                ));
            }
        };
        let host = host(var("MASTER_ADDR"))?;
        Ok(Launch {
            rank,
            world,
            local_rank,
            host,
            port,
            timeout: None,
        })
    }

    /// Rank `rank` of a job of `world` ranks started without a launcher (its id handed over by
    /// an exchange of yours): as if `RANK` and `WORLD_SIZE` were set and nothing else, so its
    /// local rank is `rank`, and its rendezvous, should it use one, listens at
    /// `127.0.0.1:29500` (`torchrun`'s default port).
    ///
    /// # Errors
    /// [`UsageError::NotARank`] for a rank at or above the world size, or a world of none;
    /// [`UsageError::PastBound`] for a world past [`MAX_WORLD`].
    pub fn new(rank: usize, world: usize) -> Result<Launch> {
        if world == 0 || rank >= world {
            return Err(UsageError::NotARank { rank, world }.into());
        }
        check_world("world", world)?;
        Ok(Launch {
            rank,
            world,
            local_rank: rank,
            host: "127.0.0.1".into(),
            port: 29500,
            timeout: None,
        })
    }

    /// This launch with one deadline for its job, which the [rendezvous](Self::rendezvous),
    /// the [join](Self::join) and the collectives of the communicator it joins inherit, each
    /// counting it from its own start, unless told otherwise
    /// ([`Rendezvous::with_timeout`], [`Communicator::with_timeout`]). `Duration::MAX` is no
    /// deadline. Without one, each step keeps its default ([`DEFAULT_BOOTSTRAP_TIMEOUT`] for
    /// the rendezvous and the join,
    /// [`DEFAULT_COLLECTIVE_TIMEOUT`](super::DEFAULT_COLLECTIVE_TIMEOUT) for each collective).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Launch {
        self.timeout = Some(timeout);
        self
    }

    /// The job's deadline, where [`with_timeout`](Self::with_timeout) set one.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The rendezvous these variables name, with the launch's deadline (or its default).
    ///
    /// # Errors
    /// [`IoError::Rendezvous`] when `MASTER_ADDR` does not resolve.
    pub fn rendezvous(&self) -> Result<Rendezvous> {
        let rendezvous = Rendezvous::new((self.host.as_str(), self.port), self.rank, self.world)?;
        Ok(match self.timeout {
            Some(timeout) => rendezvous.with_timeout(timeout),
            None => rendezvous,
        })
    }

    /// Joins this launch's rank of its world, with `engine` as its engine and rank 0's `id`
    /// ([`Communicator::join`]), waiting at most the launch's deadline (or
    /// [`DEFAULT_BOOTSTRAP_TIMEOUT`]) for every rank; the communicator's collectives inherit
    /// the launch's deadline (or [`DEFAULT_COLLECTIVE_TIMEOUT`](super::DEFAULT_COLLECTIVE_TIMEOUT)).
    ///
    /// # Errors
    /// As [`Communicator::join`]; [`PeerError::Unjoined`] names the ranks that never
    /// joined, where the collective library can tell.
    pub fn join(&self, engine: &mut CudaEngine, id: &UniqueId) -> Result<Communicator> {
        let join = self.timeout.unwrap_or(DEFAULT_BOOTSTRAP_TIMEOUT);
        let comm = Communicator::join_by(engine, id, self.rank, self.world, join)?;
        Ok(match self.timeout {
            Some(timeout) => comm.with_timeout(timeout),
            None => comm,
        })
    }
}

/// The default deadline of a rendezvous ([`Rendezvous::with_timeout`]) and of a join
/// ([`Communicator::join`], [`Launch::join`]): five minutes, long enough for every rank of a
/// large job to start.
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(300);

/// The rendezvous protocol's mark, which opens every message (its last two bytes are the
/// protocol's version).
const WIRE_MAGIC: &[u8; 8] = b"CFRDZV\x00\x01";

/// The mark without its version.
const WIRE_MARK: &[u8] = b"CFRDZV";

/// A greeting: rank, world size, job.
const HELLO: u8 = 1;
/// Rank 0's answer to a good greeting: the unique id.
const WELCOME: u8 = 2;
/// Rank 0's answer to a wrong greeting: why.
const REFUSE: u8 = 3;

/// A TCP rendezvous that hands rank 0's [`UniqueId`] to every rank.
///
/// Rank 0 listens at the address; every other rank connects (retrying until rank 0 is up, and
/// again if rank 0 closes its connection unanswered), greets it with its rank, the world's
/// size and the job's name, and waits for the id. Rank 0 reads every connection's greeting
/// at once, and answers once every rank has arrived. It refuses a greeting of another world
/// size, another job, a rank out of range or already taken, or bytes that are not the
/// protocol, and tells the peer why. Everything waits at most the rendezvous's timeout
/// ([`DEFAULT_BOOTSTRAP_TIMEOUT`] unless set), counted once from the start of
/// [`exchange`](Self::exchange), however slowly a peer sends: after it each rank has a typed
/// error saying who was missing.
///
/// The rendezvous trusts its network, and checks every message (see the guide's
/// [Running across processes](crate::guide::across_processes)).
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
    /// [`UsageError::NotARank`] for a rank at or above the world size, or a world of none;
    /// [`UsageError::PastBound`] for a world past [`MAX_WORLD`]; [`IoError::Rendezvous`] when
    /// the address does not resolve.
    pub fn new(address: impl ToSocketAddrs, rank: usize, world: usize) -> Result<Rendezvous> {
        if world == 0 || rank >= world {
            return Err(UsageError::NotARank { rank, world }.into());
        }
        check_world("world", world)?;
        let unresolved = |source| IoError::Rendezvous {
            address: "the given address".into(),
            operation: "resolve",
            source,
        };
        let address = address
            .to_socket_addrs()
            .map_err(unresolved)?
            .next()
            .ok_or_else(|| unresolved(ErrorKind::NotFound.into()))?;
        Ok(Rendezvous {
            address,
            rank,
            world,
            job: String::new(),
            timeout: DEFAULT_BOOTSTRAP_TIMEOUT,
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
    /// share a port by mistake do not join each other. A name is at most [`MAX_JOB_BYTES`]
    /// bytes: [`exchange`](Self::exchange) refuses a longer one.
    pub fn job(mut self, job: impl Into<String>) -> Rendezvous {
        self.job = job.into();
        self
    }

    /// This rendezvous with another deadline: how long it waits in all, rank 0 for every
    /// rank, the others for rank 0 ([`DEFAULT_BOOTSTRAP_TIMEOUT`] unless set, or the
    /// [launch](Launch::with_timeout)'s). `Duration::MAX` (or any duration too large for a
    /// deadline) waits for ever.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Rendezvous {
        self.timeout = timeout;
        self
    }

    /// How long the rendezvous waits in all.
    pub fn timeout(&self) -> Duration {
        self.timeout
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
    /// [`UsageError::PastBound`] for a job's name past [`MAX_JOB_BYTES`], before any socket.
    /// On rank 0, [`IoError::Rendezvous`] when it cannot listen at the address or write the id
    /// to a rank, and [`PeerError::Missing`] when not every rank arrives in time (with the
    /// connections it refused meanwhile); `make`'s error. On the others,
    /// [`PeerError::NoRoot`] when rank 0 does not answer in time,
    /// [`PeerError::RankRefused`] with rank 0's reason, [`MalformedError::Rendezvous`] for an
    /// answer that is not the protocol, and [`MalformedError::UniqueId`] for an id this
    /// process cannot use.
    pub fn exchange(&self, make: impl FnOnce() -> Result<UniqueId>) -> Result<UniqueId> {
        if self.job.len() > MAX_JOB_BYTES {
            return Err(UsageError::PastBound {
                what: "job",
                value: format!("a name of {} bytes", self.job.len()),
                limit: format!("at most {MAX_JOB_BYTES} bytes (MAX_JOB_BYTES)"),
            }
            .into());
        }
        let deadline = Deadline::after(self.timeout);
        if self.rank == 0 {
            self.serve(make, deadline)
        } else {
            self.join(deadline)
        }
    }

    fn address(&self) -> String {
        self.address.to_string()
    }

    fn io(&self, operation: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        let address = self.address();
        move |source| {
            IoError::Rendezvous {
                address,
                operation,
                source,
            }
            .into()
        }
    }

    /// Rank 0: listens, reads every connection's greeting as it comes, then answers each rank
    /// with the id.
    fn serve(
        &self,
        make: impl FnOnce() -> Result<UniqueId>,
        deadline: Deadline,
    ) -> Result<UniqueId> {
        if self.world == 1 {
            return make(); // a world of one: no one to tell
        }
        let listener = TcpListener::bind(self.address).map_err(self.io("bind"))?;
        listener.set_nonblocking(true).map_err(self.io("listen"))?;
        // `world` is at most `MAX_WORLD`: the table is under a MiB.
        let mut peers: Vec<Option<TcpStream>> = (0..self.world).map(|_| None).collect();
        let mut waiting: std::collections::VecDeque<Greeting> = Default::default();
        let mut refused = Refusals::default();
        let mut arrived = 1;
        while arrived < self.world {
            if deadline.expired() {
                let missing = (1..self.world).filter(|&r| peers[r].is_none()).collect();
                return Err(PeerError::Missing {
                    address: self.address(),
                    missing,
                    refused: refused.into_list(),
                }
                .into());
            }
            let mut progress = false;
            // Every waiting connection's greeting, as far as it has come.
            let mut i = 0;
            while i < waiting.len() {
                let step = waiting[i].advance();
                if matches!(step, Step::Waiting) && !waiting[i].until.expired() {
                    i += 1;
                    continue;
                }
                progress = true;
                let Some(greeting) = waiting.remove(i) else {
                    break;
                };
                let peer = greeting.peer;
                let reason = match step {
                    Step::Waiting => {
                        format!("no whole greeting within {GREETING_PATIENCE:?}; closed")
                    }
                    Step::Lost(reason) => reason,
                    Step::Refuse(reason) => greeting.refuse(reason),
                    Step::Greeted(body) => match self.check(&body, &peers) {
                        Ok(rank) => {
                            peers[rank] = Some(greeting.stream);
                            arrived += 1;
                            continue;
                        }
                        Err(reason) => greeting.refuse(reason),
                    },
                };
                refused.push(peer, reason);
            }
            // New connections, while there is room for them.
            loop {
                let full = waiting.len() >= MAX_UNGREETED;
                // Full, and the oldest has not had its grace: none can make room.
                if full
                    && waiting
                        .front()
                        .is_none_or(|g| g.accepted.elapsed() < GREETING_GRACE)
                {
                    break; // the newcomers wait in the listener's queue
                }
                match listener.accept() {
                    Ok((stream, peer)) => {
                        progress = true;
                        if full && let Some(oldest) = waiting.pop_front() {
                            refused.push(
                                oldest.peer,
                                format!(
                                    "no greeting while {MAX_UNGREETED} connections waited to \
                                     greet; closed for a newer one"
                                ),
                            );
                        }
                        match stream.set_nonblocking(true) {
                            Ok(()) => waiting.push_back(Greeting::new(stream, peer, deadline)),
                            Err(e) => refused.push(peer, e.to_string()),
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e)
                        if matches!(
                            e.kind(),
                            ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                        ) =>
                    {
                        continue;
                    }
                    // Out of descriptors for now: the connections wait in the queue, and the
                    // held ones close as their patience runs out.
                    Err(e) if matches!(e.raw_os_error(), Some(23 | 24)) => break,
                    Err(e) => return Err(self.io("accept")(e)),
                }
            }
            if !progress {
                let pause = if waiting.is_empty() { 2 } else { 1 };
                std::thread::sleep(Duration::from_millis(pause));
            }
        }
        drop(waiting);
        drop(listener);
        let id = make()?;
        let message = frame(WELCOME, &id.to_bytes());
        let mut failed = None;
        for stream in peers.iter_mut().flatten() {
            let written = stream
                .set_nonblocking(false)
                .and_then(|()| write_within(stream, &message, deadline));
            if let Err(e) = written {
                failed.get_or_insert(e);
            }
        }
        match failed {
            Some(e) => Err(self.io("write")(e)),
            None => Ok(id),
        }
    }

    /// The rank a greeting's `body` claims, or why rank 0 refuses it.
    fn check(
        &self,
        body: &[u8],
        peers: &[Option<TcpStream>],
    ) -> std::result::Result<usize, String> {
        // The head's check bounded the body: `HELLO_FIXED..=HELLO_MAX` bytes.
        let word = |at: usize| {
            u64::from_le_bytes(
                body[at..at + 8]
                    .try_into()
                    .expect("the head checked the length"),
            )
        };
        let (rank, world) = (word(0), word(8));
        let Ok(job) = std::str::from_utf8(&body[HELLO_FIXED..]) else {
            return Err("a job name that is not UTF-8".into());
        };
        if job != self.job {
            return Err(format!(
                "a peer of job {job:?}, where this is job {:?}",
                self.job
            ));
        }
        if world != self.world as u64 {
            return Err(format!(
                "a world of {world} ranks, where rank 0's has {}",
                self.world
            ));
        }
        let rank = match usize::try_from(rank) {
            Ok(r) if r != 0 && r < self.world => r,
            _ => {
                return Err(format!(
                    "rank {rank}, where the others are 1 to {}",
                    self.world - 1
                ));
            }
        };
        if peers[rank].is_some() {
            return Err(format!("rank {rank} arrived already"));
        }
        Ok(rank)
    }

    /// A rank other than 0: connects (retrying until rank 0 listens, and again when rank 0
    /// closes the connection unanswered), greets, and waits for the id, all by `deadline`.
    fn join(&self, deadline: Deadline) -> Result<UniqueId> {
        let mut last: Option<String> = None;
        loop {
            let Some(wait) = deadline.slice(IO_SLICE) else {
                return Err(self.no_root(last));
            };
            match TcpStream::connect_timeout(&self.address, wait) {
                Ok(stream) => match self.greet(stream, deadline) {
                    Ok(id) => return Ok(id),
                    Err(Attempt::Again(why)) => last = Some(why),
                    Err(Attempt::Fail(error)) => return Err(error),
                },
                Err(e) => last = Some(e.to_string()),
            }
            if let Some(pause) = deadline.slice(RETRY_PAUSE) {
                std::thread::sleep(pause);
            }
        }
    }

    fn no_root(&self, last: Option<String>) -> Error {
        PeerError::NoRoot {
            address: self.address(),
            last,
        }
        .into()
    }

    fn garbage(&self, reason: String) -> Attempt {
        Attempt::Fail(
            MalformedError::Rendezvous {
                address: self.address(),
                reason,
            }
            .into(),
        )
    }

    /// One attempt of a rank: its greeting on `stream`, and rank 0's answer.
    fn greet(
        &self,
        mut stream: TcpStream,
        deadline: Deadline,
    ) -> std::result::Result<UniqueId, Attempt> {
        let mut body = Vec::with_capacity(HELLO_FIXED + self.job.len());
        body.extend_from_slice(&(self.rank as u64).to_le_bytes());
        body.extend_from_slice(&(self.world as u64).to_le_bytes());
        body.extend_from_slice(self.job.as_bytes());
        let closed = |e: &std::io::Error| {
            matches!(
                e.kind(),
                ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
            )
        };
        if let Err(e) = write_within(&mut stream, &frame(HELLO, &body), deadline) {
            return Err(match e.kind() {
                _ if closed(&e) => Attempt::Again(format!("rank 0 closed the connection: {e}")),
                ErrorKind::TimedOut => {
                    Attempt::Fail(self.no_root(Some("timed out sending the greeting".into())))
                }
                _ => Attempt::Fail(self.io("write")(e)),
            });
        }
        let unanswered = |fail: ReadFail| match fail {
            ReadFail::TimedOut => {
                Attempt::Fail(self.no_root(Some("timed out waiting for rank 0's answer".into())))
            }
            ReadFail::Closed { after: 0 } => {
                Attempt::Again("rank 0 closed the connection unanswered".into())
            }
            ReadFail::Io { after: 0, error } if closed(&error) => {
                Attempt::Again(format!("rank 0 closed the connection unanswered: {error}"))
            }
            ReadFail::Closed { after } => Attempt::Fail(
                self.no_root(Some(format!("closed after {after} bytes of an answer"))),
            ),
            ReadFail::Io { error, .. } => Attempt::Fail(self.io("read")(error)),
        };
        let mut head = [0u8; HEAD];
        read_within(&mut stream, &mut head, deadline).map_err(unanswered)?;
        let (kind, len) = parse_head(&head).map_err(|r| self.garbage(r))?;
        let bound = match kind {
            WELCOME if len == ID_LEN => len,
            WELCOME => {
                return Err(self.garbage(format!("an id of {len} bytes, where one is {ID_LEN}")));
            }
            REFUSE if len <= MAX_REASON_BYTES => len,
            REFUSE => {
                return Err(self.garbage(format!(
                    "a refusal of {len} bytes, above the {MAX_REASON_BYTES} allowed"
                )));
            }
            _ => {
                return Err(self.garbage(format!("a message of kind {kind} where the id belongs")));
            }
        };
        // Bounded above: at most `MAX_REASON_BYTES` or `ID_LEN` bytes.
        let mut body = vec![0u8; bound];
        read_within(&mut stream, &mut body, deadline).map_err(|fail| match fail {
            ReadFail::Closed { after } => unanswered(ReadFail::Closed {
                after: after + HEAD,
            }),
            ReadFail::Io { after, error } => unanswered(ReadFail::Io {
                after: after + HEAD,
                error,
            }),
            timed_out => unanswered(timed_out),
        })?;
        if kind == WELCOME {
            return UniqueId::from_bytes(&body).map_err(Attempt::Fail);
        }
        Err(Attempt::Fail(
            PeerError::RankRefused {
                address: self.address(),
                rank: self.rank,
                reason: printable(&body),
            }
            .into(),
        ))
    }
}

/// How a rank's attempt to reach rank 0 ended, where it did not end with the id.
enum Attempt {
    /// Rank 0 closed the connection unanswered (it was full of strangers, say): try again.
    Again(String),
    /// The exchange's end.
    Fail(crate::error::Error),
}

/// Refusals rank 0 lists, at most [`MAX_LISTED_REFUSALS`], and how many more there were.
#[derive(Default)]
struct Refusals {
    listed: Vec<String>,
    more: usize,
}

impl Refusals {
    fn push(&mut self, peer: SocketAddr, reason: String) {
        if self.listed.len() < MAX_LISTED_REFUSALS {
            self.listed.push(format!("{peer}: {reason}"));
        } else {
            self.more += 1;
        }
    }

    fn into_list(mut self) -> Vec<String> {
        if self.more > 0 {
            self.listed
                .push(format!("and {} more connection(s) refused", self.more));
        }
        self.listed
    }
}

/// A connection rank 0 has accepted that has not greeted yet: what it sent so far.
struct Greeting {
    stream: TcpStream,
    peer: SocketAddr,
    accepted: Instant,
    /// When its patience runs out: [`GREETING_PATIENCE`] from its acceptance, or the
    /// exchange's deadline if sooner.
    until: Deadline,
    /// What it sent so far: at most a head and a greeting's body.
    got: Vec<u8>,
    /// The body's length, once the head is read.
    body: usize,
}

/// Where a greeting stands.
enum Step {
    /// Not whole yet, and nothing wrong so far.
    Waiting,
    /// A whole greeting's body, of `HELLO_FIXED..=HELLO_MAX` bytes.
    Greeted(Vec<u8>),
    /// Not the protocol: refuse it, saying why.
    Refuse(String),
    /// The connection failed or closed: nothing to answer.
    Lost(String),
}

impl Greeting {
    fn new(stream: TcpStream, peer: SocketAddr, deadline: Deadline) -> Greeting {
        Greeting {
            stream,
            peer,
            accepted: Instant::now(),
            until: deadline.min(Deadline::after(GREETING_PATIENCE)),
            got: Vec::with_capacity(HEAD),
            body: 0,
        }
    }

    /// Reads what has come (never waiting), and says where the greeting stands.
    fn advance(&mut self) -> Step {
        let mut chunk = [0u8; HEAD + HELLO_MAX];
        loop {
            let want = if self.got.len() < HEAD {
                HEAD - self.got.len()
            } else {
                HEAD + self.body - self.got.len()
            };
            if want == 0 {
                return Step::Greeted(self.got.split_off(HEAD));
            }
            match self.stream.read(&mut chunk[..want]) {
                Ok(0) => return Step::Lost("closed before a whole greeting".into()),
                Ok(n) => {
                    self.got.extend_from_slice(&chunk[..n]);
                    let marked = self.got.len().min(WIRE_MARK.len());
                    if self.got[..marked] != WIRE_MARK[..marked] {
                        return Step::Refuse(
                            "bytes that do not start with the rendezvous mark".into(),
                        );
                    }
                    if self.got.len() == HEAD {
                        match greeting_length(&self.got) {
                            Ok(len) => {
                                self.body = len;
                                self.got.reserve_exact(len);
                            }
                            Err(reason) => return Step::Refuse(reason),
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Waiting,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Step::Lost(e.to_string()),
            }
        }
    }

    /// Tells the peer why it is refused (without waiting: a peer that does not read loses the
    /// answer), and closes the connection. Returns the reason.
    fn refuse(mut self, reason: String) -> String {
        let said = cut(&reason, MAX_REASON_BYTES);
        let _ = self.stream.write_all(&frame(REFUSE, said.as_bytes()));
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        // What it sent beyond the head, read so that closing does not reset the connection
        // (and lose the answer), up to a bound.
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < DRAIN_BYTES {
            match self.stream.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
        reason
    }
}

/// The body length a greeting's `head` claims, or why it is not a greeting.
fn greeting_length(head: &[u8]) -> std::result::Result<usize, String> {
    let (kind, len) = parse_head(head)?;
    if kind != HELLO {
        return Err(format!("a message of kind {kind} where a greeting belongs"));
    }
    if !(HELLO_FIXED..=HELLO_MAX).contains(&len) {
        return Err(format!(
            "a greeting of {len} bytes, where one is {HELLO_FIXED} to {HELLO_MAX}"
        ));
    }
    Ok(len)
}

/// A message's kind and the body length its head claims (not yet bounded: the reader bounds
/// it by the kind it expects), or why the head is not the protocol's.
fn parse_head(head: &[u8]) -> std::result::Result<(u8, usize), String> {
    if &head[..WIRE_MARK.len()] != WIRE_MARK {
        return Err("bytes that do not start with the rendezvous mark".into());
    }
    if head[..8] != WIRE_MAGIC[..] {
        return Err(format!(
            "rendezvous protocol version {}, where this crate speaks {}",
            u16::from_be_bytes([head[6], head[7]]),
            u16::from_be_bytes([WIRE_MAGIC[6], WIRE_MAGIC[7]])
        ));
    }
    let len = u32::from_le_bytes(head[9..13].try_into().expect("four bytes"));
    Ok((head[8], usize::try_from(len).unwrap_or(usize::MAX)))
}

/// One message: the mark, its kind, its length and its body (of at most a few KiB).
fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + body.len());
    out.extend_from_slice(WIRE_MAGIC);
    out.push(kind);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// A refusal's reason as text: not UTF-8 and control characters replaced.
fn printable(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .map(|c| if c.is_control() { '\u{fffd}' } else { c })
        .collect()
}

/// Writes `bytes` on a blocking `stream` by `deadline`: each write waits at most what is left
/// of it (a write that has room never waits, even once the deadline has passed).
fn write_within(stream: &mut TcpStream, bytes: &[u8], deadline: Deadline) -> std::io::Result<()> {
    let mut done = 0;
    while done < bytes.len() {
        let slice = deadline.slice(IO_SLICE);
        stream.set_write_timeout(Some(slice.unwrap_or(Duration::from_micros(1))))?;
        match stream.write(&bytes[done..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if slice.is_none() || deadline.expired() {
                    return Err(ErrorKind::TimedOut.into());
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why a read did not fill its buffer.
enum ReadFail {
    /// The deadline passed.
    TimedOut,
    /// The peer closed the connection after `after` bytes.
    Closed { after: usize },
    /// The system's error, after `after` bytes.
    Io { after: usize, error: std::io::Error },
}

/// Fills `buf` from a blocking `stream` by `deadline`, however the bytes trickle: each read
/// waits at most what is left of it.
fn read_within(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Deadline,
) -> std::result::Result<(), ReadFail> {
    let mut done = 0;
    while done < buf.len() {
        let Some(slice) = deadline.slice(IO_SLICE) else {
            return Err(ReadFail::TimedOut);
        };
        if let Err(error) = stream.set_read_timeout(Some(slice)) {
            return Err(ReadFail::Io { after: done, error });
        }
        match stream.read(&mut buf[done..]) {
            Ok(0) => return Err(ReadFail::Closed { after: done }),
            Ok(n) => done += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(error) => return Err(ReadFail::Io { after: done, error }),
        }
    }
    Ok(())
}
