//! Bad input on the sharing wire, against the simulated device: an exporter's offers caught on
//! their way to the importer and spoiled one field at a time, and bytes that are not the
//! protocol. Each must be refused with its typed error, map nothing, close the descriptor that
//! came with it, and tell the exporter, whose tensor then comes back.

use super::wire::{self, Message, Offer};
use super::{Importer, ShareLink};
use crate::driver::sim::{SimConfig, SimDevice, SimOp};
use crate::error::{Error, MalformedError, PeerError, SetupError, UsageError};
use crate::lifecycle::pending::{Operation, TryWait};
use crate::memory::element::Element;
use crate::{CudaEngine, DeviceTensor, Pending, download_tensor};
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// The tensor of a loan or a reclaim, back within `within` (it must come back).
fn back<Op, T: Element>(pending: Pending<Op>, within: std::time::Duration) -> DeviceTensor<T>
where
    Op: Operation<Parts = DeviceTensor<T>>,
{
    match pending.wait_for(within).unwrap() {
        TryWait::Returned(back) => back.into_parts(),
        TryWait::InFlight(op) => panic!("still in flight: {op:?}"),
    }
}

/// An exporter and an importer of one simulated machine, with the test in between: what the
/// exporter sends arrives on `from_exporter`, and what the test sends on `to_importer` reaches
/// the importer's link.
struct Between {
    // The test's ends go first when it is dropped, so each side sees the other's end at once.
    from_exporter: UnixStream,
    to_importer: UnixStream,
    link: ShareLink,
    handle: Importer,
    importer: CudaEngine,
    exporter: CudaEngine,
    sim: SimDevice,
}

fn between() -> Between {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let mut importer = CudaEngine::simulated_on(&sim);
    let (exporter_end, mut from_exporter) = UnixStream::pair().unwrap();
    let (mut to_importer, importer_end) = UnixStream::pair().unwrap();
    let link = ShareLink::from_stream(&mut importer, importer_end).unwrap();
    // The importer's greeting, passed on to the exporter as it was.
    let (hello, _) = wire::recv(&mut to_importer).unwrap();
    wire::send(&mut from_exporter, &hello, None).unwrap();
    let handle = Importer::from_stream(&mut exporter, exporter_end).unwrap();
    Between {
        sim,
        exporter,
        importer,
        handle,
        link,
        from_exporter,
        to_importer,
    }
}

impl Between {
    /// A fresh tensor of four `f32`s offered read-only, as the exporter sent it.
    fn offer(&mut self) -> (super::Exported<f32>, Box<Offer>, OwnedFd) {
        let tensor = self.exporter.full(&[4], 2.0f32).unwrap();
        let shared = self.exporter.export_tensor(tensor).unwrap();
        self.handle.offer(&mut self.exporter, &shared).unwrap();
        match wire::recv(&mut self.from_exporter).unwrap() {
            (Message::Offer(offer), Some(fd)) => (shared, offer, fd),
            other => panic!("{other:?}"),
        }
    }

    /// Passes the importer's answer back to the exporter and returns it.
    fn answer(&mut self) -> Message {
        let (answer, _) = wire::recv(&mut self.to_importer).unwrap();
        wire::send(&mut self.from_exporter, &answer, None).unwrap();
        answer
    }
}

/// Offers spoiled by `spoil`, taken by `take`, refused as `expect` says, with nothing mapped,
/// the descriptor closed, the exporter told, and its tensor back.
fn refused(
    spoil: impl FnOnce(&mut Offer),
    pipe_for_fd: bool,
    take: impl FnOnce(&mut ShareLink, &mut CudaEngine) -> crate::Result<()>,
    expect: impl FnOnce(&Error) -> bool,
) {
    let mut b = between();
    let (shared, mut offer, fd) = b.offer();
    spoil(&mut offer);
    // A pipe's read end in place of the pool's descriptor shows whether it was closed.
    let (read_end, mut write_end) = std::io::pipe().unwrap();
    let read_end = OwnedFd::from(read_end);
    let sent_fd = if pipe_for_fd {
        read_end.as_fd()
    } else {
        fd.as_fd()
    };
    wire::send(&mut b.to_importer, &Message::Offer(offer), Some(sent_fd)).unwrap();
    drop(read_end);
    let error = take(&mut b.link, &mut b.importer).unwrap_err();
    assert!(expect(&error), "{error}");
    assert_eq!(b.sim.imports_live(), 0, "mapped");
    assert!(
        matches!(b.answer(), Message::Refuse { mapped: false, .. }),
        "the exporter is told"
    );
    if pipe_for_fd {
        // Every read end is closed once the link goes: the importer keeps the descriptor it
        // received only for the pool's import (which a refusal before it must not lose).
        let Between {
            link, to_importer, ..
        } = b;
        drop((to_importer, link));
        let err = write_end.write_all(b"x").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
        let tensor = back(shared.reclaim(), std::time::Duration::from_secs(5));
        assert_eq!(download_tensor(&mut b.exporter, &tensor).unwrap(), [2.0; 4]);
        assert!(b.sim.violations().is_empty(), "{:?}", b.sim.violations());
        return;
    }
    let tensor = back(shared.reclaim(), std::time::Duration::from_secs(5));
    assert_eq!(download_tensor(&mut b.exporter, &tensor).unwrap(), [2.0; 4]);
    assert!(b.sim.violations().is_empty(), "{:?}", b.sim.violations());
}

fn read(link: &mut ShareLink, engine: &mut CudaEngine) -> crate::Result<()> {
    link.import_read::<f32>(engine).map(drop)
}

fn share(e: &Error, check: impl FnOnce(&Error) -> bool) -> bool {
    check(e)
}

#[test]
fn an_offer_of_another_host_or_boot_is_refused() {
    refused(
        |o| o.origin.host[0] ^= 1,
        true,
        read,
        |e| share(e, |s| matches!(s, Error::Setup(SetupError::OtherHost))),
    );
    refused(
        |o| o.origin.boot[3] ^= 1,
        true,
        read,
        |e| share(e, |s| matches!(s, Error::Setup(SetupError::OtherBoot))),
    );
}

#[test]
fn an_offer_of_a_process_that_has_exited_is_refused() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    refused(
        |o| o.origin.pid = pid,
        true,
        read,
        |e| {
            share(
                e,
                |s| matches!(s, Error::Peer(PeerError::ProcessGone { pid: p }) if *p == pid),
            )
        },
    );
}

#[test]
fn an_offer_of_a_device_the_engine_cannot_reach_is_refused() {
    refused(
        |o| o.device = [0x5a; 16],
        true,
        read,
        |e| {
            share(
                e,
                |s| matches!(s, Error::Setup(SetupError::UnreachableDevice { uuid }) if *uuid == [0x5a; 16]),
            )
        },
    );
}

#[test]
fn an_offer_of_another_element_type_access_or_size_is_refused() {
    refused(
        |_| {},
        true,
        |link, engine| link.import_read::<i32>(engine).map(drop),
        |e| {
            share(e, |s| {
                matches!(
                    s,
                    Error::Usage(UsageError::OfferElementType {
                        offered: Some(crate::DType::F32),
                        ..
                    })
                )
            })
        },
    );
    refused(
        |_| {},
        true,
        |link, engine| link.import_exclusive::<f32>(engine).map(drop),
        |e| {
            share(e, |s| {
                matches!(
                    s,
                    Error::Usage(UsageError::OfferAccess {
                        offered: "read-only",
                        ..
                    })
                )
            })
        },
    );
    refused(
        |o| o.bytes += 4,
        true,
        read,
        |e| {
            share(
                e,
                |s| matches!(s, Error::Malformed(MalformedError::Sharing { reason }) if reason.contains("bytes")),
            )
        },
    );
}

#[test]
fn forged_handles_are_refused_by_the_driver() {
    // A descriptor that names no pool.
    refused(
        |_| {},
        true,
        read,
        |e| {
            matches!(
                e,
                Error::Driver {
                    call: "cuMemPoolImportFromShareableHandle",
                    ..
                }
            )
        },
    );
    // Export data that names no allocation, and an event handle that names no event.
    refused(
        |o| o.event = [0x33; 64],
        false,
        read,
        |e| {
            matches!(
                e,
                Error::Driver {
                    call: "cuIpcOpenEventHandle",
                    ..
                }
            )
        },
    );
    refused(
        |o| o.pointer = [0x44; 64],
        false,
        read,
        |e| {
            matches!(
                e,
                Error::Driver {
                    call: "cuMemPoolImportPointer",
                    ..
                }
            )
        },
    );
}

#[test]
fn truncated_bytes_end_the_link_with_nothing_mapped() {
    let mut b = between();
    let (_shared, offer, fd) = b.offer();
    // The offer's first bytes, with its descriptor, then the end.
    let mut whole = UnixStream::pair().unwrap();
    wire::send(&mut whole.0, &Message::Offer(offer), Some(fd.as_fd())).unwrap();
    drop(fd);
    let mut bytes = vec![0u8; 40];
    std::io::Read::read_exact(&mut whole.1, &mut bytes).unwrap();
    b.to_importer.write_all(&bytes).unwrap();
    b.to_importer.shutdown(std::net::Shutdown::Write).unwrap();
    let error = read(&mut b.link, &mut b.importer).unwrap_err();
    assert!(
        share(
            &error,
            |s| matches!(s, Error::Malformed(MalformedError::Sharing { reason }) if reason.contains("cut short"))
        ),
        "{error}"
    );
    assert_eq!(b.sim.calls(SimOp::PoolImportPointer), 0);
    assert_eq!(b.sim.imports_live(), 0);
    // The link is over: a later import says so.
    let error = read(&mut b.link, &mut b.importer).unwrap_err();
    assert!(
        share(&error, |s| matches!(s, Error::Peer(PeerError::Closed))),
        "{error}"
    );
}

#[test]
fn a_first_offer_without_the_pools_descriptor_is_refused() {
    let mut b = between();
    let (shared, offer, fd) = b.offer();
    drop(fd);
    wire::send(&mut b.to_importer, &Message::Offer(offer), None).unwrap();
    let error = read(&mut b.link, &mut b.importer).unwrap_err();
    assert!(
        share(
            &error,
            |s| matches!(s, Error::Malformed(MalformedError::Sharing { reason }) if reason.contains("descriptor"))
        ),
        "{error}"
    );
    assert_eq!(b.sim.imports_live(), 0);
    assert!(matches!(b.answer(), Message::Refuse { mapped: false, .. }));
    back(shared.reclaim(), std::time::Duration::from_secs(5));
}

// ---- Issue 36: a share's size from the allocation, refusals that leave the link usable,
// bounds on what an exporter can make the importer hold, and every field of an offer checked.

/// How long a test waits for a side that should answer at once.
const WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Between {
    /// Sends `offer` to the importer, with `fd` beside it.
    fn pass(&mut self, offer: Box<Offer>, fd: Option<&OwnedFd>) {
        let fd = fd.map(AsFd::as_fd);
        wire::send(&mut self.to_importer, &Message::Offer(offer), fd).unwrap();
    }

    /// The exporter's next offer of `shared`, as it sent it (with no descriptor: the first
    /// offer carried it).
    fn again(&mut self, shared: &super::Exported<f32>) -> Box<Offer> {
        self.handle.offer(&mut self.exporter, shared).unwrap();
        match wire::recv(&mut self.from_exporter).unwrap() {
            (Message::Offer(offer), None) => offer,
            other => panic!("{other:?}"),
        }
    }

    /// Passes every answer the importer sends within a moment back to the exporter.
    fn drain(&mut self) -> Vec<Message> {
        let wait = std::time::Duration::from_millis(200);
        self.to_importer.set_read_timeout(Some(wait)).unwrap();
        let mut answers = Vec::new();
        while let Ok((answer, _)) = wire::recv(&mut self.to_importer) {
            wire::send(&mut self.from_exporter, &answer, None).unwrap();
            answers.push(answer);
        }
        self.to_importer.set_read_timeout(None).unwrap();
        answers
    }

    /// Waits until the link's reader has stopped reading.
    fn reader_ended(&self) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < WAIT {
            if self.link.reader_ended() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        false
    }
}

fn past(e: &Error, claimed: u64) -> bool {
    share(e, |s| {
        matches!(s, Error::Malformed(MalformedError::PastAllocation { offered, offset: 0, allocation })
            if *offered == claimed && *allocation < claimed)
    })
}

#[test]
fn a_relayed_second_offer_rewritten_past_its_allocation_is_refused() {
    // The relay passes the first offer as it was, then rewrites the second of the same tensor
    // (whose mapping the link keeps) from 16 bytes to 4096.
    let mut b = between();
    let (shared, offer, fd) = b.offer();
    b.pass(offer, Some(&fd));
    drop(fd);
    let first = b.link.import_read::<f32>(&mut b.importer).unwrap();
    let mut second = b.again(&shared);
    second.shape = vec![1024];
    second.bytes = 4096;
    b.pass(second, None);
    let error = read(&mut b.link, &mut b.importer).unwrap_err();
    assert!(past(&error, 4096), "{error}");
    assert!(
        error.to_string().contains("4096") && error.to_string().contains("16"),
        "{error}"
    );
    // The exporter is told; the first import still reads its 16 bytes.
    let answers = b.drain();
    assert!(
        matches!(answers[..], [Message::Refuse { mapped: true, .. }]),
        "{answers:?}"
    );
    assert_eq!(download_tensor(&mut b.importer, &first).unwrap(), [2.0; 4]);
    // A later honest offer still imports.
    let third = b.again(&shared);
    b.pass(third, None);
    let honest = b.link.import_read::<f32>(&mut b.importer).unwrap();
    assert_eq!(download_tensor(&mut b.importer, &honest).unwrap(), [2.0; 4]);
    drop((first, honest));
    b.drain();
    back(shared.reclaim(), WAIT);
    assert!(b.sim.violations().is_empty(), "{:?}", b.sim.violations());
}

#[test]
fn a_first_offer_past_its_allocation_is_unmapped_and_the_exporter_told() {
    for exclusive in [false, true] {
        let mut b = between();
        let tensor = b.exporter.full(&[4], 2.0f32).unwrap();
        let (lent, shared) = if exclusive {
            (Some(b.handle.lend(&mut b.exporter, tensor).unwrap()), None)
        } else {
            let shared = b.exporter.export_tensor(tensor).unwrap();
            b.handle.offer(&mut b.exporter, &shared).unwrap();
            (None, Some(shared))
        };
        let (mut offer, fd) = match wire::recv(&mut b.from_exporter).unwrap() {
            (Message::Offer(offer), Some(fd)) => (offer, fd),
            other => panic!("{other:?}"),
        };
        offer.shape = vec![32, 32];
        offer.bytes = 4096;
        b.pass(offer, Some(&fd));
        drop(fd);
        let error = if exclusive {
            b.link.import_exclusive::<f32>(&mut b.importer).map(drop)
        } else {
            read(&mut b.link, &mut b.importer)
        }
        .unwrap_err();
        assert!(past(&error, 4096), "{error}");
        b.importer.synchronize().unwrap();
        assert_eq!(b.sim.imports_live(), 0, "unmapped");
        told_mapped_then_unmapped(&b.drain());
        // The exporter has its tensor back, whole.
        let tensor = match (lent, shared) {
            (Some(lent), _) => back(lent, WAIT),
            (_, Some(shared)) => back(shared.reclaim(), WAIT),
            _ => unreachable!(),
        };
        // The refusal is reported at the exporter's next boundary.
        assert!(matches!(b.exporter.flush(), Err(Error::Deferred { .. })));
        assert_eq!(download_tensor(&mut b.exporter, &tensor).unwrap(), [2.0; 4]);
        b.exporter.synchronize().unwrap();
        assert!(b.sim.violations().is_empty(), "{:?}", b.sim.violations());
    }
}

/// Which descriptor travels with the spoiled offer.
#[derive(Clone, Copy, PartialEq)]
enum Fd {
    /// The pool's, as the exporter sent it.
    Real,
    /// A pipe's, in its place (a forged one).
    Pipe,
    /// None.
    Without,
}

/// One kind of refusal: how an offer is spoiled, and how the importer must refuse it.
struct Case {
    name: &'static str,
    /// Whether an honest offer is taken first, so the spoiled one is a later offer.
    later: bool,
    spoil: fn(&mut Offer),
    fd: Fd,
    take: fn(&mut ShareLink, &mut CudaEngine) -> crate::Result<()>,
    expect: fn(&Error) -> bool,
}

fn garbage_saying(e: &Error, says: &str) -> bool {
    share(
        e,
        |s| matches!(s, Error::Malformed(MalformedError::Sharing { reason }) if reason.contains(says)),
    )
}

/// The spoiled offer refused as `case` says, then an honest offer on the same link imported.
fn refused_then_good(case: &Case) {
    let name = case.name;
    let mut b = between();
    let (shared, mut offer, fd) = b.offer();
    // The pool's descriptor, until the importer is given it.
    let mut real = Some(fd);
    let mut held = Vec::new();
    if case.later {
        b.pass(offer, real.take().as_ref());
        held.push(b.link.import_read::<f32>(&mut b.importer).unwrap());
        offer = b.again(&shared);
    }
    (case.spoil)(&mut offer);
    let (pipe, _write_end) = std::io::pipe().unwrap();
    let pipe = OwnedFd::from(pipe);
    let sent = match case.fd {
        Fd::Real => real.take(),
        Fd::Pipe => Some(pipe),
        Fd::Without => None,
    };
    b.pass(offer, sent.as_ref());
    drop(sent);
    let error = (case.take)(&mut b.link, &mut b.importer).unwrap_err();
    assert!((case.expect)(&error), "{name}: {error}");
    let answers = b.drain();
    assert!(
        matches!(answers.first(), Some(Message::Refuse { .. })),
        "{name}: the exporter is told: {answers:?}"
    );
    // The link is still usable: the exporter's next offer imports (with the pool's descriptor
    // where the importer never had it).
    let good = b.again(&shared);
    b.pass(good, real.as_ref());
    let tensor = b
        .link
        .import_read::<f32>(&mut b.importer)
        .unwrap_or_else(|e| panic!("{name}: the next offer after the refusal: {e}"));
    assert_eq!(
        download_tensor(&mut b.importer, &tensor).unwrap(),
        [2.0; 4],
        "{name}"
    );
    drop((tensor, held));
    b.drain();
    back(shared.reclaim(), WAIT);
    assert!(
        b.sim.violations().is_empty(),
        "{name}: {:?}",
        b.sim.violations()
    );
}

#[test]
fn a_refusal_of_every_kind_leaves_the_link_usable() {
    let cases = [
        Case {
            name: "another element type",
            later: false,
            spoil: |_| {},
            fd: Fd::Real,
            take: |link, engine| link.import_read::<i32>(engine).map(drop),
            expect: |e| {
                share(e, |s| {
                    matches!(s, Error::Usage(UsageError::OfferElementType { .. }))
                })
            },
        },
        Case {
            name: "an element type this crate does not know",
            later: false,
            spoil: |o| o.dtype = 200,
            fd: Fd::Real,
            take: read,
            expect: |e| {
                share(e, |s| {
                    matches!(
                        s,
                        Error::Usage(UsageError::OfferElementType { offered: None, .. })
                    )
                })
            },
        },
        Case {
            name: "another access",
            later: false,
            spoil: |_| {},
            fd: Fd::Real,
            take: |link, engine| link.import_exclusive::<f32>(engine).map(drop),
            expect: |e| {
                share(e, |s| {
                    matches!(s, Error::Usage(UsageError::OfferAccess { .. }))
                })
            },
        },
        Case {
            name: "a shape that disagrees with the byte count",
            later: false,
            spoil: |o| o.bytes += 4,
            fd: Fd::Real,
            take: read,
            expect: |e| garbage_saying(e, "bytes"),
        },
        Case {
            name: "an empty shape",
            later: false,
            spoil: |o| {
                o.shape = vec![0, 4];
                o.bytes = 0;
            },
            fd: Fd::Real,
            take: read,
            expect: |e| garbage_saying(e, "shape"),
        },
        Case {
            name: "a shape whose element count overflows",
            later: false,
            spoil: |o| o.shape = vec![1 << 40, 1 << 40, 1 << 40],
            fd: Fd::Real,
            take: read,
            expect: |e| garbage_saying(e, "overflow"),
        },
        Case {
            name: "a size past the allocation",
            later: false,
            spoil: |o| {
                o.shape = vec![1024];
                o.bytes = 4096;
            },
            fd: Fd::Real,
            take: read,
            expect: |e| past(e, 4096),
        },
        Case {
            name: "a size past the kept mapping",
            later: true,
            spoil: |o| {
                o.shape = vec![2, 4];
                o.bytes = 32;
            },
            fd: Fd::Without,
            take: read,
            expect: |e| past(e, 32),
        },
        Case {
            name: "another host",
            later: false,
            spoil: |o| o.origin.host[0] ^= 1,
            fd: Fd::Real,
            take: read,
            expect: |e| share(e, |s| matches!(s, Error::Setup(SetupError::OtherHost))),
        },
        Case {
            name: "another boot",
            later: false,
            spoil: |o| o.origin.boot[0] ^= 1,
            fd: Fd::Real,
            take: read,
            expect: |e| share(e, |s| matches!(s, Error::Setup(SetupError::OtherBoot))),
        },
        Case {
            name: "a process that has exited",
            later: false,
            spoil: |o| o.origin.start ^= 1,
            fd: Fd::Real,
            take: read,
            expect: |e| {
                share(e, |s| {
                    matches!(s, Error::Peer(PeerError::ProcessGone { .. }))
                        || matches!(s, Error::Malformed(MalformedError::Sharing { .. }))
                })
            },
        },
        Case {
            name: "a device the engine cannot reach",
            later: false,
            spoil: |o| o.device = [0x5a; 16],
            fd: Fd::Real,
            take: read,
            expect: |e| {
                share(e, |s| {
                    matches!(s, Error::Setup(SetupError::UnreachableDevice { .. }))
                })
            },
        },
        Case {
            name: "a first offer without the pool's descriptor",
            later: false,
            spoil: |_| {},
            fd: Fd::Without,
            take: read,
            expect: |e| garbage_saying(e, "descriptor"),
        },
        Case {
            name: "a forged descriptor",
            later: false,
            spoil: |_| {},
            fd: Fd::Pipe,
            take: read,
            expect: |e| driver_refused(e, "cuMemPoolImportFromShareableHandle"),
        },
        Case {
            name: "a forged event",
            later: false,
            spoil: |o| o.event = [0x33; 64],
            fd: Fd::Real,
            take: read,
            expect: |e| driver_refused(e, "cuIpcOpenEventHandle"),
        },
        Case {
            name: "forged export data",
            later: false,
            spoil: |o| o.pointer = [0x44; 64],
            fd: Fd::Real,
            take: read,
            expect: |e| driver_refused(e, "cuMemPoolImportPointer"),
        },
        Case {
            name: "a mapped tensor named by other export data",
            later: true,
            spoil: |o| o.pointer[40] ^= 1,
            fd: Fd::Without,
            take: read,
            expect: |e| garbage_saying(e, "export data"),
        },
        Case {
            name: "a later offer of another exporter",
            later: true,
            spoil: |o| o.origin.pid ^= 1,
            fd: Fd::Without,
            take: read,
            expect: |e| garbage_saying(e, "another exporter"),
        },
        Case {
            name: "a later offer of another device",
            later: true,
            spoil: |o| o.device[15] ^= 1,
            fd: Fd::Without,
            take: read,
            expect: |e| garbage_saying(e, "another exporter"),
        },
        Case {
            name: "a later offer with a forged event",
            later: true,
            spoil: |o| o.event = [0x33; 64],
            fd: Fd::Without,
            take: read,
            expect: |e| driver_refused(e, "cuIpcOpenEventHandle"),
        },
        Case {
            name: "a later offer of another element type",
            later: true,
            spoil: |_| {},
            fd: Fd::Without,
            take: |link, engine| link.import_read::<u32>(engine).map(drop),
            expect: |e| {
                share(e, |s| {
                    matches!(s, Error::Usage(UsageError::OfferElementType { .. }))
                })
            },
        },
    ];
    let mut failed = Vec::new();
    for case in &cases {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            refused_then_good(case);
        }));
        if outcome.is_err() {
            failed.push(case.name);
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

#[test]
fn offers_never_taken_past_the_bound_close_the_link() {
    let mut b = between();
    let (_shared, offer, fd) = b.offer();
    b.pass(offer.clone(), Some(&fd));
    for _ in 0..super::import::MAX_WAITING_OFFERS {
        b.pass(offer.clone(), None);
    }
    assert!(
        b.reader_ended(),
        "the link still reads after {} offers waiting",
        super::import::MAX_WAITING_OFFERS + 1
    );
    let error = read(&mut b.link, &mut b.importer).unwrap_err();
    assert!(
        share(&error, |s| matches!(
            s,
            Error::Malformed(MalformedError::OverLimit { limit, .. }) if *limit == super::import::MAX_WAITING_OFFERS
        )),
        "{error}"
    );
    // Every later import says so too, and nothing was mapped.
    let again = read(&mut b.link, &mut b.importer).unwrap_err();
    assert!(
        share(&again, |s| matches!(
            s,
            Error::Malformed(MalformedError::OverLimit { .. })
        )),
        "{again}"
    );
    assert_eq!(b.sim.imports_live(), 0);
}

#[test]
fn a_second_descriptor_while_the_link_holds_one_closes_it_and_is_closed() {
    let mut b = between();
    let (_shared, offer, fd) = b.offer();
    b.pass(offer.clone(), Some(&fd));
    let (pipe, mut write_end) = std::io::pipe().unwrap();
    let pipe = OwnedFd::from(pipe);
    b.pass(offer, Some(&pipe));
    drop(pipe);
    assert!(b.reader_ended(), "the link still reads");
    let error = read(&mut b.link, &mut b.importer).unwrap_err();
    assert!(
        share(
            &error,
            |s| matches!(s, Error::Malformed(MalformedError::OverLimit { limit: 1, what }) if what.contains("descriptor"))
        ),
        "{error}"
    );
    // The second descriptor is closed.
    let err = write_end.write_all(b"x").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
    assert_eq!(b.sim.imports_live(), 0);
}

#[test]
fn a_descriptor_after_the_pool_was_imported_is_closed_at_once() {
    let mut b = between();
    let (shared, offer, fd) = b.offer();
    b.pass(offer, Some(&fd));
    let first = b.link.import_read::<f32>(&mut b.importer).unwrap();
    let (pipe, mut write_end) = std::io::pipe().unwrap();
    let pipe = OwnedFd::from(pipe);
    let second = b.again(&shared);
    b.pass(second, Some(&pipe));
    drop(pipe);
    let tensor = b.link.import_read::<f32>(&mut b.importer).unwrap();
    let err = write_end.write_all(b"x").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
    drop((first, tensor));
    b.drain();
    back(shared.reclaim(), WAIT);
}

#[test]
fn unmap_requests_for_tensors_never_offered_hold_nothing() {
    let mut b = between();
    const REQUESTS: u64 = 100_000;
    for id in 0..REQUESTS {
        wire::send(&mut b.to_importer, &Message::Unmap { id: id + 1000 }, None).unwrap();
    }
    // The reader takes messages in order: once this offer is imported, every request was read.
    let (shared, offer, fd) = b.offer();
    b.pass(offer, Some(&fd));
    let tensor = b.link.import_read::<f32>(&mut b.importer).unwrap();
    let held = b.link.unmaps_held();
    assert!(held == 0, "{held} unmap requests held of {REQUESTS}");
    assert_eq!(download_tensor(&mut b.importer, &tensor).unwrap(), [2.0; 4]);
    drop(tensor);
    b.drain();
    back(shared.reclaim(), WAIT);
}

#[test]
fn an_unmap_request_for_an_offer_not_yet_taken_unmaps_it_once_released() {
    let mut b = between();
    let (shared, offer, fd) = b.offer();
    let id = offer.id;
    b.pass(offer, Some(&fd));
    // The exporter asks for it back before the importer took the offer.
    wire::send(&mut b.to_importer, &Message::Unmap { id }, None).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(b.link.unmaps_held(), 1);
    let tensor = b.link.import_read::<f32>(&mut b.importer).unwrap();
    assert_eq!(b.link.unmaps_held(), 0);
    drop(tensor);
    b.importer.synchronize().unwrap();
    assert_eq!(b.sim.imports_live(), 0, "unmapped once released");
    let answers = b.drain();
    assert!(
        matches!(
            answers[..],
            [Message::Release { .. }, Message::Unmapped { .. }]
        ),
        "{answers:?}"
    );
    back(shared.reclaim(), WAIT);
}

// ---- The driver's refusal to measure a fresh mapping (`cuMemGetAddressRange`), and a driver
// panic there.

#[test]
fn a_mapping_the_driver_will_not_measure_is_unmapped_and_the_exporter_told() {
    use crate::error::DriverError;
    for exclusive in [false, true] {
        let mut b = between();
        let tensor = b.exporter.full(&[4], 2.0f32).unwrap();
        let (lent, shared) = if exclusive {
            (Some(b.handle.lend(&mut b.exporter, tensor).unwrap()), None)
        } else {
            let shared = b.exporter.export_tensor(tensor).unwrap();
            b.handle.offer(&mut b.exporter, &shared).unwrap();
            (None, Some(shared))
        };
        let (offer, fd) = match wire::recv(&mut b.from_exporter).unwrap() {
            (Message::Offer(offer), Some(fd)) => (offer, fd),
            other => panic!("{other:?}"),
        };
        b.pass(offer, Some(&fd));
        drop(fd);
        b.sim
            .fail_nth(SimOp::GetAddressRange, 1, DriverError::UNKNOWN);
        let imported = if exclusive {
            b.link.import_exclusive::<f32>(&mut b.importer).map(drop)
        } else {
            read(&mut b.link, &mut b.importer)
        };
        let error = imported.unwrap_err();
        assert!(
            matches!(
                error,
                Error::Driver {
                    call: "cuMemGetAddressRange",
                    source: DriverError::UNKNOWN,
                }
            ),
            "{error}"
        );
        assert_eq!(b.sim.calls(SimOp::PoolImportPointer), 1, "it was mapped");
        assert_eq!(b.sim.calls(SimOp::GetAddressRange), 1);
        // The mapping is released, stream-ordered, and never used.
        b.importer.synchronize().unwrap();
        assert_eq!(
            b.sim.imports_live(),
            0,
            "the unmeasured mapping is released"
        );
        // The exporter is told it was mapped, then that it is unmapped.
        told_mapped_then_unmapped(&b.drain());
        // Its counts come down: the tensor comes back whole, and the link goes on.
        let tensor = match (lent, shared) {
            (Some(lent), _) => back(lent, WAIT),
            (_, Some(shared)) => {
                assert_eq!(shared.imports(), 0, "the exporter still counts the import");
                let again = b.again(&shared);
                b.pass(again, None);
                let honest = b.link.import_read::<f32>(&mut b.importer).unwrap();
                assert_eq!(download_tensor(&mut b.importer, &honest).unwrap(), [2.0; 4]);
                drop(honest);
                b.drain();
                back(shared.reclaim(), WAIT)
            }
            _ => unreachable!(),
        };
        assert!(matches!(b.exporter.flush(), Err(Error::Deferred { .. })));
        assert_eq!(download_tensor(&mut b.exporter, &tensor).unwrap(), [2.0; 4]);
        drop(tensor);
        b.exporter.synchronize().unwrap();
        assert!(b.sim.violations().is_empty(), "{:?}", b.sim.violations());
    }
}

#[test]
fn a_driver_panic_mapping_or_measuring_leaks_the_mapping_and_the_link_never_says_it_holds_nothing()
{
    // A panic before the measure takes effect, and after it or the mapping did.
    // (What, the call, whether the panic comes after the call took effect.)
    let cases = [
        ("before the measure", SimOp::GetAddressRange, false),
        ("after the measure", SimOp::GetAddressRange, true),
        ("after the mapping", SimOp::PoolImportPointer, true),
    ];
    for (name, op, after) in cases {
        let mut b = between();
        let (shared, offer, fd) = b.offer();
        b.pass(offer, Some(&fd));
        drop(fd);
        if after {
            b.sim.panic_after_nth(op, 1);
        } else {
            b.sim.panic_nth(op, 1);
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = read(&mut b.link, &mut b.importer);
        }));
        assert!(outcome.is_err(), "{name}: the driver's panic goes through");
        b.sim.clear_faults();
        // The mapping is leaked, never released; the exporter is told nothing.
        assert_eq!(
            b.sim.imports_live(),
            1,
            "{name}: a panic released the mapping"
        );
        // The link goes: it must not say it holds nothing (a goodbye), so the exporter keeps
        // its memory while this process lives.
        let Between {
            link,
            mut to_importer,
            mut from_exporter,
            handle,
            mut exporter,
            importer,
            sim,
        } = b;
        let dropped = std::thread::spawn(move || drop(link));
        to_importer
            .set_read_timeout(Some(std::time::Duration::from_millis(500)))
            .unwrap();
        let mut answers = Vec::new();
        while let Ok((answer, _)) = wire::recv(&mut to_importer) {
            wire::send(&mut from_exporter, &answer, None).unwrap();
            answers.push(answer);
        }
        assert!(
            !answers.iter().any(|m| matches!(m, Message::Goodbye)),
            "{name}: {answers:?}"
        );
        drop((to_importer, from_exporter));
        dropped.join().unwrap();
        let kept = shared
            .reclaim()
            .wait_for(std::time::Duration::from_millis(200))
            .unwrap();
        assert!(
            matches!(kept, TryWait::InFlight(_)),
            "{name}: the exporter has its tensor back under a mapping"
        );
        drop((kept, handle));
        exporter.synchronize().ok();
        assert!(
            sim.violations().is_empty(),
            "{name}: {:?}",
            sim.violations()
        );
        drop((exporter, importer));
    }
}

#[test]
fn an_exporter_that_stops_reading_holds_an_importers_send_only_for_the_limit() {
    let mut b = between();
    // The link's socket has the exporter side's write timeout.
    assert_eq!(b.link.write_limit(), Some(wire::MESSAGE_LIMIT));
    // The test's end reads nothing: the importer's messages fill the socket, and the send
    // that finds no room fails at the limit (shortened here) with a typed error.
    let limit = std::time::Duration::from_millis(100);
    b.link.set_write_limit(limit);
    let mut sent = 0u64;
    let error = loop {
        let start = std::time::Instant::now();
        match b.link.send_as_link(&Message::Release { id: sent }) {
            Ok(()) => sent += 1,
            Err(error) => {
                let waited = start.elapsed();
                assert!(waited >= limit / 2 && waited < WAIT, "{waited:?}");
                break error;
            }
        }
        assert!(sent < 1_000_000, "the socket never filled");
    };
    assert!(
        share(&error, |s| matches!(
            s,
            Error::Peer(PeerError::TimedOut { within, .. }) if *within == wire::MESSAGE_LIMIT
        )),
        "{error}"
    );
    // The writer is cut: a later send writes nothing and waits for nothing.
    let start = std::time::Instant::now();
    b.link.send_as_link(&Message::Release { id: sent }).unwrap();
    assert!(start.elapsed() < limit, "a send after the cut waited");
    // The exporter's end reads every whole message, in order, then the end: nothing runs on
    // from a partial one.
    let mut got = 0u64;
    let end = loop {
        match wire::recv(&mut b.to_importer) {
            Ok((Message::Release { id }, None)) => {
                assert_eq!(id, got);
                got += 1;
            }
            Ok(other) => panic!("{other:?}"),
            Err(end) => break end,
        }
    };
    assert_eq!(got, sent, "{end}");
    assert!(matches!(end, Error::Peer(PeerError::Closed)), "{end}");
}

/// Asserts that the exporter was told of a refused offer's mapping, then of its unmapping, and
/// of nothing else.
fn told_mapped_then_unmapped(answers: &[Message]) {
    assert!(
        matches!(
            answers,
            [
                Message::Refuse { mapped: true, .. },
                Message::Unmapped { .. }
            ]
        ),
        "{answers:?}"
    );
}

/// Whether `error` is the driver's refusal of `call`.
fn driver_refused(error: &Error, call: &str) -> bool {
    matches!(error, Error::Driver { call: c, .. } if *c == call)
}
