//! Device tensors shared between processes on one host: the route, its wire and its rules.
//!
//! The mechanism is CUDA's stream-ordered pool shared through a file descriptor: the engine's
//! allocations come from a memory pool, and a pool made exportable
//! (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) is imported by another process from its
//! descriptor (`cuMemPoolImportFromShareableHandle`, once per exporting pool), and each of its
//! allocations from 64 bytes of export data (`cuMemPoolImportPointer`). The alternatives do not
//! fit the crate's allocator: legacy IPC handles (`cuIpcGetMemHandle`) need `cuMemAlloc`'d
//! memory, outside the engine's stream-ordered pool, and virtual-memory handles need an
//! allocator of the crate's own. Measured on the H200 (`docs/records/shared-between-processes.md`):
//! the pool is exported before any of its pointers can be, a pointer's import costs 68–97 µs once
//! its pool is imported (the pool's own import and an inter-process event's open cost about
//! 0.2 ms each, so both are kept per exporter), and imported memory stays valid after the
//! exporting process exits.
//!
//! What sharing hands back later (a lent tensor, a reclaimed share, an importer's leaving) is an
//! operation in flight, [`Pending`](crate::Pending) over [`Loan`], [`Reclaim`] or [`Departure`],
//! waited on with the verbs of every operation in flight ([`crate::pending`]).
//!
//! Offers, releases and refusals travel on a Unix socket ([`wire`]), the pool's descriptor
//! beside an offer, each message checked as it is read; a handle of another host, another boot
//! or a process that has exited is refused before anything is mapped.

mod export;
mod import;
mod pending;
#[cfg(test)]
mod tests;
pub(crate) mod wire;

pub use export::{Exported, Importer, ShareListener};
pub use import::{ReadOnly, ShareLink};
pub use pending::{Departure, Loan, Reclaim};
