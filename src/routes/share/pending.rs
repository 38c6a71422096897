//! What sharing hands back later, as operations in flight ([`Pending`](crate::Pending)): a
//! tensor lent to one importer ([`Loan`]), a read-only share being taken back for writing
//! ([`Reclaim`]), and an importer's leaving ([`Departure`]). Each is waited on with the verbs
//! of every operation in flight ([`crate::pending`]): `is_ready`, `wait`, `try_wait`,
//! `wait_for` (`Duration::MAX`: no bound) and `.await`.
//!
//! Their completion is proven by the importers, not by an event of this engine: a loan or a
//! reclaim is complete once no import of the tensor is in use (each release, hand-back or
//! unmapping is counted by the connection's reader after it has ordered this engine's next use
//! of the memory after the importer's last, on the device: see [`export`](super::export)), and
//! a departure once the importer's connection is over and it holds nothing. A wait sleeps on the
//! export's (or the connection's) condition variable; an `.await` registers its waker there, and
//! the connection's reader thread wakes it when the count (or the connection) changes: nothing
//! polls. The reader holds no engine lock when it wakes.

use super::export::{Conn, Export, lock};
use crate::error::Result;
use crate::lifecycle::pending::flight::Flight;
use crate::lifecycle::pending::{InFlight, Operation, Pending, Returned, sealed};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use crate::sync::deadline::Deadline;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// Numbers for awaits, unique in the process: the key of each one's waker.
static NEXT_AWAIT: AtomicU64 = AtomicU64::new(1);

/// The tasks awaiting a change of an export's imports or of a connection, one waker per await.
#[derive(Default)]
pub(super) struct Wakers(HashMap<u64, Waker>);

impl Wakers {
    /// Registers (or renews) await `key`'s waker.
    fn register(&mut self, key: u64, waker: &Waker) {
        match self.0.get_mut(&key) {
            Some(held) if held.will_wake(waker) => {}
            _ => {
                self.0.insert(key, waker.clone());
            }
        }
    }

    /// Forgets await `key`'s waker (it resolved, or was dropped).
    fn remove(&mut self, key: u64) {
        self.0.remove(&key);
    }

    /// Takes every waker, to wake once the lock that guards them is released.
    pub(super) fn take(&mut self) -> Woken {
        Woken(std::mem::take(&mut self.0))
    }
}

/// Wakers taken from a [`Wakers`], woken by [`wake`](Self::wake) with no lock held.
#[must_use = "the tasks are woken only by `wake`"]
pub(super) struct Woken(HashMap<u64, Waker>);

impl Woken {
    /// Wakes every task (each may poll again, and registers again if still not done).
    pub(super) fn wake(self) {
        for (_, waker) in self.0 {
            waker.wake();
        }
    }
}

/// What a loan or a reclaim holds in flight: the tensor, and its export entry, whose imports in
/// use must all end before the tensor comes back.
pub struct Back<T: Element> {
    tensor: DeviceTensor<T>,
    export: Arc<Export>,
}

impl<T: Element> std::fmt::Debug for Back<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Back")
            .field("tensor", &self.tensor)
            .field("imports", &self.export.imports())
            .finish()
    }
}

impl<T: Element> Back<T> {
    /// `tensor`, whose export entry is `export`, in flight until no import of it is in use.
    pub(super) fn new(tensor: DeviceTensor<T>, export: Arc<Export>) -> Self {
        Back { tensor, export }
    }

    /// The tensor once no import is in use, waiting until `deadline`; `self` back past it.
    /// When an importer's last use could not be ordered before this engine's next, the memory
    /// is kept for good (the tensor is leaked) and the failure comes back.
    fn finish(self, deadline: Deadline) -> Result<std::result::Result<DeviceTensor<T>, Self>> {
        match self.export.wait_released(deadline) {
            Ok(true) => Ok(Ok(self.tensor)),
            Ok(false) => Ok(Err(self)),
            Err(error) => {
                let mut tensor = self.tensor;
                tensor.leak_memory();
                Err(error)
            }
        }
    }
}

impl<T: Element> Flight for Back<T> {
    type Done = DeviceTensor<T>;
    type Poller = BackPoller<T>;

    fn is_ready(&self) -> Result<bool> {
        // A use that could not be ordered is ready too: the wait then reports it.
        Ok(lock(&self.export.inner).settled())
    }

    fn wait(self) -> Result<DeviceTensor<T>> {
        let mut back = self;
        loop {
            match back.finish(Deadline::never())? {
                Ok(tensor) => return Ok(tensor),
                Err(still) => back = still,
            }
        }
    }

    fn try_wait(self) -> Result<std::result::Result<DeviceTensor<T>, Self>> {
        self.finish(Deadline::after(Duration::ZERO))
    }

    fn wait_until(self, deadline: Deadline) -> Result<std::result::Result<DeviceTensor<T>, Self>> {
        self.finish(deadline)
    }

    fn poller(self) -> BackPoller<T> {
        BackPoller {
            export: Arc::clone(&self.export),
            back: Some(self),
            key: NEXT_AWAIT.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn poll(poller: &mut BackPoller<T>, cx: &mut Context<'_>) -> Poll<Result<DeviceTensor<T>>> {
        let back = poller
            .back
            .take()
            .expect("a share's future polled after it resolved");
        {
            // Checked and registered under the lock the reader counts under: a release counted
            // after this check wakes the waker registered here.
            let mut inner = lock(&poller.export.inner);
            if !inner.settled() {
                inner.wakers.register(poller.key, cx.waker());
                drop(inner);
                poller.back = Some(back);
                return Poll::Pending;
            }
            inner.wakers.remove(poller.key);
        }
        match back.finish(Deadline::after(Duration::ZERO)) {
            Ok(Ok(tensor)) => Poll::Ready(Ok(tensor)),
            Err(error) => Poll::Ready(Err(error)),
            Ok(Err(back)) => {
                // Not reached (nothing counts a new import of a tensor in flight), but harmless:
                // polled again at once.
                poller.back = Some(back);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

/// The state of an `.await` on a loan or a reclaim.
pub struct BackPoller<T: Element> {
    back: Option<Back<T>>,
    export: Arc<Export>,
    key: u64,
}

impl<T: Element> std::fmt::Debug for BackPoller<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackPoller")
            .field("resolved", &self.back.is_none())
            .finish_non_exhaustive()
    }
}

// Nothing is pinned structurally: the device holds the tensor's address, not the future's.
impl<T: Element> Unpin for BackPoller<T> {}

impl<T: Element> Drop for BackPoller<T> {
    fn drop(&mut self) {
        lock(&self.export.inner).wakers.remove(self.key);
    }
}

/// The operation of [`Importer::lend`](super::Importer::lend): a tensor handed over exclusively
/// to one importer process, complete once the importer has handed it back (or its process has
/// ended). Its [parts](Operation::Parts) are the tensor, every use of it on the exporting engine
/// ordered after the importer's writes.
///
/// In flight this engine has no access to the tensor. Dropping it in flight frees nothing the
/// importer maps: the memory is kept until it has handed the tensor back and unmapped it (or its
/// process has ended), then freed stream-ordered.
pub struct Loan<T: Element>(PhantomData<fn() -> T>);

impl<T: Element> std::fmt::Debug for Loan<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Loan").field(&T::DTYPE).finish()
    }
}

/// The operation of [`Exported::reclaim`](super::Exported::reclaim): a tensor shared read-only,
/// taken back for writing, complete once every importer has released it. Its
/// [parts](Operation::Parts) are the tensor, every use of it on the exporting engine ordered
/// after the importers' reads.
///
/// In flight the tensor stays readable on the exporting engine ([`tensor`](Pending::tensor)),
/// never written, and no new importer is offered it. Dropping it in flight is dropping the
/// share: the memory is kept until no importer maps it, then freed stream-ordered.
pub struct Reclaim<T: Element>(PhantomData<fn() -> T>);

impl<T: Element> std::fmt::Debug for Reclaim<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Reclaim").field(&T::DTYPE).finish()
    }
}

macro_rules! back_operation {
    ($op:ident, $name:literal) => {
        impl<T: Element> sealed::Sealed for $op<T> {}

        impl<T: Element> Operation for $op<T> {
            type Parts = DeviceTensor<T>;
            type Flight = Back<T>;
            type Landed = DeviceTensor<T>;
            const NAME: &'static str = $name;

            fn land(tensor: DeviceTensor<T>) -> DeviceTensor<T> {
                tensor
            }

            fn into_parts(tensor: DeviceTensor<T>) -> DeviceTensor<T> {
                tensor
            }
        }

        impl<T: Element> Pending<$op<T>, Returned> {
            /// The tensor, back: every use on the exporting engine from now on runs after the
            /// importers' last uses (on the device).
            pub fn tensor(&self) -> &DeviceTensor<T> {
                &self.hold
            }
        }
    };
}

back_operation!(Loan, "share loan");
back_operation!(Reclaim, "share reclaim");

impl<T: Element> Pending<Reclaim<T>, InFlight> {
    /// The tensor, for reading on the exporting engine while importers still read it (as
    /// [`Exported`](super::Exported) dereferences to it): the borrow is shared, so nothing can
    /// write it or free it until it is back.
    pub fn tensor(&self) -> &DeviceTensor<T> {
        &self.hold.tensor
    }

    /// The imports still in use.
    pub fn imports(&self) -> usize {
        self.hold.export.imports()
    }
}

impl<T: Element> Pending<Loan<T>, InFlight> {
    /// Whether the importer still holds the tensor: `1` until it has handed it back, then `0`.
    pub fn imports(&self) -> usize {
        self.hold.export.imports()
    }
}

/// The operation of [`Importer::departure`](super::Importer::departure): an importer's
/// connection, complete once it is over and the importer holds nothing of this exporter's (it
/// released and unmapped everything and closed its end, or its process ended and the driver
/// tore its context down). It owns nothing: its [parts](Operation::Parts) are `()`, and dropping
/// it in flight changes nothing.
#[derive(Debug)]
pub enum Departure {}

impl sealed::Sealed for Departure {}

impl Operation for Departure {
    type Parts = ();
    type Flight = Leaving;
    type Landed = ();
    const NAME: &'static str = "importer departure";

    fn land((): ()) {}

    fn into_parts((): ()) {}
}

/// What a departure holds in flight: the importer's connection.
pub struct Leaving {
    conn: Arc<Conn>,
}

impl std::fmt::Debug for Leaving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leaving")
            .field("departed", &self.conn.departed())
            .finish()
    }
}

impl Leaving {
    /// The departure of `conn`'s importer.
    pub(super) fn new(conn: Arc<Conn>) -> Self {
        Leaving { conn }
    }
}

impl Flight for Leaving {
    type Done = ();
    type Poller = LeavingPoller;

    fn is_ready(&self) -> Result<bool> {
        Ok(self.conn.departed())
    }

    fn wait(self) -> Result<()> {
        while !self.conn.wait_departed(Deadline::never()) {}
        Ok(())
    }

    fn try_wait(self) -> Result<std::result::Result<(), Self>> {
        Ok(if self.conn.departed() {
            Ok(())
        } else {
            Err(self)
        })
    }

    fn wait_until(self, deadline: Deadline) -> Result<std::result::Result<(), Self>> {
        Ok(if self.conn.wait_departed(deadline) {
            Ok(())
        } else {
            Err(self)
        })
    }

    fn poller(self) -> LeavingPoller {
        LeavingPoller {
            conn: self.conn,
            key: NEXT_AWAIT.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn poll(poller: &mut LeavingPoller, cx: &mut Context<'_>) -> Poll<Result<()>> {
        // Registered before the check: the reader sets the connection's state before it takes
        // the wakers, so a change this check misses wakes the waker registered here.
        lock(poller.conn.wakers()).register(poller.key, cx.waker());
        if poller.conn.departed() {
            lock(poller.conn.wakers()).remove(poller.key);
            return Poll::Ready(Ok(()));
        }
        Poll::Pending
    }
}

/// The state of an `.await` on a departure.
pub struct LeavingPoller {
    conn: Arc<Conn>,
    key: u64,
}

impl std::fmt::Debug for LeavingPoller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeavingPoller")
            .field("departed", &self.conn.departed())
            .finish()
    }
}

impl Drop for LeavingPoller {
    fn drop(&mut self) {
        lock(self.conn.wakers()).remove(self.key);
    }
}
