//! Bad input on the sharing wire, against the simulated device: an exporter's offers caught on
//! their way to the importer and spoiled one field at a time, and bytes that are not the
//! protocol. Each must be refused with its typed error, map nothing, close the descriptor that
//! came with it, and tell the exporter, whose tensor then comes back.

use super::wire::{self, Message, Offer};
use super::{Importer, ShareLink};
use crate::driver::sim::{SimConfig, SimDevice, SimOp};
use crate::error::{Error, ShareError};
use crate::{CudaEngine, download_tensor};
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

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
        // Every read end is closed: the importer closed the one it received.
        let err = write_end.write_all(b"x").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
    }
    let tensor = shared.reclaim(std::time::Duration::from_secs(5)).unwrap();
    assert_eq!(download_tensor(&mut b.exporter, &tensor).unwrap(), [2.0; 4]);
    assert!(b.sim.violations().is_empty(), "{:?}", b.sim.violations());
}

fn read(link: &mut ShareLink, engine: &mut CudaEngine) -> crate::Result<()> {
    link.import_read::<f32>(engine).map(drop)
}

fn share(e: &Error, check: impl FnOnce(&ShareError) -> bool) -> bool {
    matches!(e, Error::Share(s) if check(s))
}

#[test]
fn an_offer_of_another_host_or_boot_is_refused() {
    refused(
        |o| o.origin.host[0] ^= 1,
        true,
        read,
        |e| share(e, |s| matches!(s, ShareError::OtherHost)),
    );
    refused(
        |o| o.origin.boot[3] ^= 1,
        true,
        read,
        |e| share(e, |s| matches!(s, ShareError::OtherBoot)),
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
                |s| matches!(s, ShareError::ProcessGone { pid: p } if *p == pid),
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
                |s| matches!(s, ShareError::Unreachable { uuid } if *uuid == [0x5a; 16]),
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
                    ShareError::ElementType {
                        offered: Some(crate::DType::F32),
                        ..
                    }
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
                    ShareError::Access {
                        offered: "read-only",
                        ..
                    }
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
                |s| matches!(s, ShareError::Garbage { reason } if reason.contains("bytes")),
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
            |s| matches!(s, ShareError::Garbage { reason } if reason.contains("cut short"))
        ),
        "{error}"
    );
    assert_eq!(b.sim.calls(SimOp::PoolImportPointer), 0);
    assert_eq!(b.sim.imports_live(), 0);
    // The link is over: a later import says so.
    let error = read(&mut b.link, &mut b.importer).unwrap_err();
    assert!(
        share(&error, |s| matches!(s, ShareError::Closed)),
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
            |s| matches!(s, ShareError::Garbage { reason } if reason.contains("descriptor"))
        ),
        "{error}"
    );
    assert_eq!(b.sim.imports_live(), 0);
    assert!(matches!(b.answer(), Message::Refuse { mapped: false, .. }));
    shared.reclaim(std::time::Duration::from_secs(5)).unwrap();
}
