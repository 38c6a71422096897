//! Model test, end to end: pending uploads, downloads and resubmissions of per-index distinct
//! data (never zeros) through pinned buffers, registered buffers (`Vec`s page-locked in place)
//! and device tensors, with device-to-device copies, blocking reads, detached transfers,
//! registered buffers taken back with `into_vec` or forgotten (idle, or inside an in-flight
//! transfer) and random device advances, on the simulated device. The pinned pool keeps its
//! default budget, so blocks are reused: a block released too early would be handed out again
//! while a copy still reads or writes it, and a registered buffer unregistered too early would
//! be a violation the device records.
//!
//! The reference model knows what every buffer and every device tensor holds (or that it is
//! unspecified: a fresh tensor, a fresh uninitialised buffer), and the device clock. Every
//! download that comes back, every blocking read and every buffer the test looks at must hold
//! exactly what the model says; transfers must be ready exactly when the clock has passed their
//! event.

use cuferry::sim::{SimDevice, Violation};
use cuferry::{
    CudaEngine, DeviceTensor, Pending, PinnedHostBuffer, RegisteredBuffer, download_pending,
    download_tensor,
    pending::{Download, HostBuffer, InFlight, Operation, Returned, TryWait, Upload},
    upload_pending, upload_tensor,
};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use std::collections::VecDeque;

// ---------------------------------------------------------------------------------------------
// The reference model.
// ---------------------------------------------------------------------------------------------

/// The lengths in play: 1, a few, and one past a page of `f32`s.
const LENS: [usize; 3] = [1, 5, 1025];

/// Per-index distinct values, never zero, distinct across salts (exact in `f32`).
fn distinct(len: usize, salt: u16) -> Vec<f32> {
    (0..len)
        .map(|i| f32::from(salt) * 2048.0 + i as f32 + 0.5)
        .collect()
}

/// Contents: `None` when unspecified.
type Data = Option<Vec<f32>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Up,
    Down,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Held by the test on its own.
    Idle,
    /// Owned by transfer `h`.
    InTransfer(usize),
    Dropped,
    /// Passed to `mem::forget`, alone or inside an in-flight transfer: leaked for good.
    Forgotten,
}

#[derive(Clone, Debug)]
struct Obj {
    len: usize,
    data: Data,
    place: Place,
    /// A registered buffer (a `Vec` page-locked in place) rather than a pinned one.
    registered: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HState {
    InFlight { marker: u64 },
    Returned,
    Gone,
}

#[derive(Clone, Debug)]
struct Transfer {
    dir: Dir,
    buf: usize,
    ten: usize,
    state: HState,
}

#[derive(Clone, Debug, Default)]
struct Model {
    next_seq: u64,
    done_seq: u64,
    /// The events of detached transfers in the engine's retirement queue, oldest first.
    retire: VecDeque<u64>,
    bufs: Vec<Obj>,
    tens: Vec<Obj>,
    transfers: Vec<Transfer>,
}

#[derive(Clone, Debug)]
enum Transition {
    /// `PinnedHostBuffer::from_slice` with distinct data.
    NewBuffer {
        len: usize,
        salt: u16,
    },
    /// `PinnedHostBuffer::new`: contents unspecified (maybe a reused pool block).
    NewEmptyBuffer {
        len: usize,
    },
    /// `RegisteredBuffer::register` of a `Vec` of distinct data.
    NewRegistered {
        len: usize,
        salt: u16,
    },
    /// `RegisteredBuffer::into_vec` of an idle registered buffer: the `Vec` must hold the model's
    /// data.
    IntoVec {
        buf: usize,
    },
    /// `mem::forget` of an idle registered buffer: its registration and memory leak.
    ForgetBuffer {
        buf: usize,
    },
    /// `mem::forget` of an in-flight transfer over a registered buffer: the copy still runs,
    /// into or from memory that is never unregistered or freed.
    Forget {
        h: usize,
    },
    /// `alloc_tensor`: contents unspecified.
    NewTensor {
        len: usize,
    },
    /// `upload_tensor` (blocking) with distinct data.
    UploadTensor {
        len: usize,
        salt: u16,
    },
    Upload {
        buf: usize,
        ten: usize,
    },
    Download {
        ten: usize,
        buf: usize,
    },
    IsReady {
        h: usize,
    },
    Wait {
        h: usize,
    },
    TryWait {
        h: usize,
    },
    /// Refill a returned transfer's buffer through `buffer_mut`.
    Refill {
        h: usize,
        salt: u16,
    },
    Resubmit {
        h: usize,
    },
    IntoParts {
        h: usize,
    },
    DropReturned {
        h: usize,
    },
    /// Drop an in-flight transfer: it detaches into the retirement queue, and its buffer must
    /// not return to the pool (and be handed out again) before its copy has run.
    Detach {
        h: usize,
    },
    /// A queued device-to-device copy between two idle tensors.
    CopyInto {
        src: usize,
        dst: usize,
    },
    /// A queued device-to-device copy from a returned transfer's tensor into an idle tensor.
    CopyFromReturned {
        h: usize,
        dst: usize,
    },
    /// A blocking download of an idle tensor.
    ReadTensor {
        ten: usize,
    },
    /// A blocking download of a returned transfer's tensor.
    ReadReturned {
        h: usize,
    },
    /// Compare an idle buffer with the model.
    CheckBuffer {
        buf: usize,
    },
    DropBuffer {
        buf: usize,
    },
    DropTensor {
        ten: usize,
    },
    Advance {
        ops: usize,
    },
    Synchronize,
}

impl Model {
    fn idle(objs: &[Obj]) -> impl Iterator<Item = usize> + '_ {
        (0..objs.len()).filter(move |&i| objs[i].place == Place::Idle)
    }

    /// Idle (first, second) pairs of equal length.
    fn matching(first: &[Obj], second: &[Obj]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for a in Self::idle(first) {
            for b in Self::idle(second) {
                if first[a].len == second[b].len {
                    out.push((a, b));
                }
            }
        }
        out
    }

    fn transfers_where(&self, f: impl Fn(&Transfer) -> bool) -> Vec<usize> {
        (0..self.transfers.len())
            .filter(|&h| f(&self.transfers[h]))
            .collect()
    }

    /// Queues a copy and an event record; returns the record's sequence number.
    fn queue_transfer(&mut self) -> u64 {
        self.next_seq += 2;
        self.next_seq - 1
    }

    /// A blocking route: a copy, an event record, and a wait for it (everything queued runs).
    fn blocking(&mut self) {
        self.next_seq += 2;
        self.done_seq = self.next_seq;
    }

    /// The copy of transfer `h` (applied at submission: nothing else can reach either side
    /// until the transfer returns, and the stream runs in order).
    fn copy(&mut self, h: usize) {
        let t = &self.transfers[h];
        match t.dir {
            Dir::Up => self.tens[t.ten].data = self.bufs[t.buf].data.clone(),
            Dir::Down => self.bufs[t.buf].data = self.tens[t.ten].data.clone(),
        }
    }

    /// The retirement queue's poll (at `PinnedHostBuffer::new` and `synchronize`): releases the
    /// detached transfers whose event has completed (each release queues its tensor's free);
    /// with `front_only`, stops at the first that has not.
    fn poll(&mut self, front_only: bool) {
        let mut keep = VecDeque::new();
        let mut released = 0;
        while let Some(marker) = self.retire.pop_front() {
            if marker < self.done_seq {
                released += 1;
            } else {
                keep.push_back(marker);
                if front_only {
                    break;
                }
            }
        }
        keep.append(&mut self.retire);
        self.retire = keep;
        self.next_seq += released;
    }

    fn returned_ten(&self, h: usize) -> usize {
        self.transfers[h].ten
    }
}

fn is_in_flight(t: &Transfer) -> bool {
    matches!(t.state, HState::InFlight { .. })
}
fn is_returned(t: &Transfer) -> bool {
    t.state == HState::Returned
}

fn len() -> impl Strategy<Value = usize> {
    select(LENS.to_vec())
}
/// Salts below the ones `init_state` uses; all keep `distinct` exact in `f32`.
fn salt() -> impl Strategy<Value = u16> {
    1..2000u16
}

struct EndToEndModel;

impl ReferenceStateMachine for EndToEndModel {
    type State = Model;
    type Transition = Transition;

    /// One buffer and one uploaded tensor of each length, so transfers start at once.
    fn init_state() -> BoxedStrategy<Model> {
        let mut m = Model::default();
        for (i, &len) in LENS.iter().enumerate() {
            let salt = 2000 + 2 * i as u16;
            m = Self::apply(m, &Transition::NewBuffer { len, salt });
            m = Self::apply(
                m,
                &Transition::UploadTensor {
                    len,
                    salt: salt + 1,
                },
            );
        }
        Just(m).boxed()
    }

    fn transitions(m: &Model) -> BoxedStrategy<Transition> {
        use Transition as T;
        let mut c: Vec<(u32, BoxedStrategy<T>)> = vec![
            (
                2,
                (len(), salt())
                    .prop_map(|(len, salt)| T::NewBuffer { len, salt })
                    .boxed(),
            ),
            (1, len().prop_map(|len| T::NewEmptyBuffer { len }).boxed()),
            (
                2,
                (len(), salt())
                    .prop_map(|(len, salt)| T::NewRegistered { len, salt })
                    .boxed(),
            ),
            (1, len().prop_map(|len| T::NewTensor { len }).boxed()),
            (
                1,
                (len(), salt())
                    .prop_map(|(len, salt)| T::UploadTensor { len, salt })
                    .boxed(),
            ),
            (3, (0..5usize).prop_map(|ops| T::Advance { ops }).boxed()),
            (1, Just(T::Synchronize).boxed()),
        ];
        let up = Model::matching(&m.bufs, &m.tens);
        if !up.is_empty() {
            c.push((
                8,
                select(up)
                    .prop_map(|(buf, ten)| T::Upload { buf, ten })
                    .boxed(),
            ));
        }
        let down = Model::matching(&m.tens, &m.bufs);
        if !down.is_empty() {
            c.push((
                8,
                select(down)
                    .prop_map(|(ten, buf)| T::Download { ten, buf })
                    .boxed(),
            ));
        }
        let copies = Model::matching(&m.tens, &m.tens);
        let copies: Vec<_> = copies.into_iter().filter(|(a, b)| a != b).collect();
        if !copies.is_empty() {
            c.push((
                2,
                select(copies)
                    .prop_map(|(src, dst)| T::CopyInto { src, dst })
                    .boxed(),
            ));
        }
        let in_flight = m.transfers_where(is_in_flight);
        if !in_flight.is_empty() {
            let s = || select(in_flight.clone());
            c.push((1, s().prop_map(|h| T::IsReady { h }).boxed()));
            c.push((4, s().prop_map(|h| T::Wait { h }).boxed()));
            c.push((3, s().prop_map(|h| T::TryWait { h }).boxed()));
            c.push((2, s().prop_map(|h| T::Detach { h }).boxed()));
            let over_registered =
                m.transfers_where(|t| is_in_flight(t) && m.bufs[t.buf].registered);
            if !over_registered.is_empty() {
                c.push((
                    1,
                    select(over_registered)
                        .prop_map(|h| T::Forget { h })
                        .boxed(),
                ));
            }
        }
        let returned = m.transfers_where(is_returned);
        if !returned.is_empty() {
            let s = || select(returned.clone());
            let uploads = m.transfers_where(|t| is_returned(t) && t.dir == Dir::Up);
            if !uploads.is_empty() {
                c.push((
                    4,
                    (select(uploads), salt())
                        .prop_map(|(h, salt)| T::Refill { h, salt })
                        .boxed(),
                ));
            }
            c.push((4, s().prop_map(|h| T::Resubmit { h }).boxed()));
            c.push((2, s().prop_map(|h| T::IntoParts { h }).boxed()));
            c.push((2, s().prop_map(|h| T::DropReturned { h }).boxed()));
            c.push((3, s().prop_map(|h| T::ReadReturned { h }).boxed()));
            let from: Vec<(usize, usize)> = returned
                .iter()
                .flat_map(|&h| {
                    let len = m.tens[m.returned_ten(h)].len;
                    Model::idle(&m.tens)
                        .filter(move |&d| m.tens[d].len == len)
                        .map(move |d| (h, d))
                })
                .collect();
            if !from.is_empty() {
                c.push((
                    3,
                    select(from)
                        .prop_map(|(h, dst)| T::CopyFromReturned { h, dst })
                        .boxed(),
                ));
            }
        }
        let idle_bufs: Vec<usize> = Model::idle(&m.bufs).collect();
        if !idle_bufs.is_empty() {
            c.push((
                2,
                select(idle_bufs.clone())
                    .prop_map(|buf| T::CheckBuffer { buf })
                    .boxed(),
            ));
            c.push((
                1,
                select(idle_bufs)
                    .prop_map(|buf| T::DropBuffer { buf })
                    .boxed(),
            ));
        }
        let idle_registered: Vec<usize> = Model::idle(&m.bufs)
            .filter(|&b| m.bufs[b].registered)
            .collect();
        if !idle_registered.is_empty() {
            c.push((
                1,
                select(idle_registered.clone())
                    .prop_map(|buf| T::IntoVec { buf })
                    .boxed(),
            ));
            c.push((
                1,
                select(idle_registered)
                    .prop_map(|buf| T::ForgetBuffer { buf })
                    .boxed(),
            ));
        }
        let idle_tens: Vec<usize> = Model::idle(&m.tens).collect();
        if !idle_tens.is_empty() {
            c.push((
                2,
                select(idle_tens.clone())
                    .prop_map(|ten| T::ReadTensor { ten })
                    .boxed(),
            ));
            c.push((
                1,
                select(idle_tens)
                    .prop_map(|ten| T::DropTensor { ten })
                    .boxed(),
            ));
        }
        proptest::strategy::Union::new_weighted(c).boxed()
    }

    fn preconditions(m: &Model, t: &Transition) -> bool {
        let idle = |objs: &[Obj], i: usize| objs.get(i).is_some_and(|o| o.place == Place::Idle);
        let tr = |h: usize| m.transfers.get(h);
        match *t {
            Transition::Upload { buf, ten } | Transition::Download { ten, buf } => {
                idle(&m.bufs, buf) && idle(&m.tens, ten) && m.bufs[buf].len == m.tens[ten].len
            }
            Transition::CopyInto { src, dst } => {
                src != dst
                    && idle(&m.tens, src)
                    && idle(&m.tens, dst)
                    && m.tens[src].len == m.tens[dst].len
            }
            Transition::CopyFromReturned { h, dst } => {
                tr(h).is_some_and(is_returned)
                    && idle(&m.tens, dst)
                    && m.tens[m.returned_ten(h)].len == m.tens[dst].len
            }
            Transition::IsReady { h }
            | Transition::Wait { h }
            | Transition::TryWait { h }
            | Transition::Detach { h } => tr(h).is_some_and(is_in_flight),
            Transition::Forget { h } => {
                tr(h).is_some_and(|t| is_in_flight(t) && m.bufs[t.buf].registered)
            }
            Transition::IntoVec { buf } | Transition::ForgetBuffer { buf } => {
                idle(&m.bufs, buf) && m.bufs[buf].registered
            }
            Transition::Refill { h, .. } => {
                tr(h).is_some_and(|t| is_returned(t) && t.dir == Dir::Up)
            }
            Transition::Resubmit { h }
            | Transition::IntoParts { h }
            | Transition::DropReturned { h }
            | Transition::ReadReturned { h } => tr(h).is_some_and(is_returned),
            Transition::CheckBuffer { buf } | Transition::DropBuffer { buf } => idle(&m.bufs, buf),
            Transition::ReadTensor { ten } | Transition::DropTensor { ten } => idle(&m.tens, ten),
            Transition::NewBuffer { .. }
            | Transition::NewEmptyBuffer { .. }
            | Transition::NewRegistered { .. }
            | Transition::NewTensor { .. }
            | Transition::UploadTensor { .. }
            | Transition::Advance { .. }
            | Transition::Synchronize => true,
        }
    }

    fn apply(mut m: Model, t: &Transition) -> Model {
        let obj = |len, data| Obj {
            len,
            data,
            place: Place::Idle,
            registered: false,
        };
        match *t {
            Transition::NewBuffer { len, salt } => {
                m.poll(true);
                m.bufs.push(obj(len, Some(distinct(len, salt))));
            }
            Transition::NewEmptyBuffer { len } => {
                m.poll(true);
                m.bufs.push(obj(len, None));
            }
            Transition::NewRegistered { len, salt } => {
                // Registration polls nothing and queues nothing.
                m.bufs.push(Obj {
                    registered: true,
                    ..obj(len, Some(distinct(len, salt)))
                });
            }
            Transition::IntoVec { buf } => m.bufs[buf].place = Place::Dropped,
            Transition::ForgetBuffer { buf } => m.bufs[buf].place = Place::Forgotten,
            Transition::Forget { h } => {
                let Transfer { buf, ten, .. } = m.transfers[h];
                m.transfers[h].state = HState::Gone;
                m.bufs[buf].place = Place::Forgotten;
                m.tens[ten].place = Place::Forgotten;
            }
            Transition::Detach { h } => {
                let HState::InFlight { marker } = m.transfers[h].state else {
                    unreachable!()
                };
                let Transfer { buf, ten, .. } = m.transfers[h];
                m.transfers[h].state = HState::Gone;
                m.bufs[buf].place = Place::Dropped;
                m.tens[ten].place = Place::Dropped;
                m.retire.push_back(marker);
            }
            Transition::NewTensor { len } => m.tens.push(obj(len, None)),
            Transition::UploadTensor { len, salt } => {
                m.blocking();
                m.tens.push(obj(len, Some(distinct(len, salt))));
            }
            Transition::Upload { buf, ten } | Transition::Download { ten, buf } => {
                let h = m.transfers.len();
                let dir = if matches!(t, Transition::Upload { .. }) {
                    Dir::Up
                } else {
                    Dir::Down
                };
                let marker = m.queue_transfer();
                m.transfers.push(Transfer {
                    dir,
                    buf,
                    ten,
                    state: HState::InFlight { marker },
                });
                m.bufs[buf].place = Place::InTransfer(h);
                m.tens[ten].place = Place::InTransfer(h);
                m.copy(h);
            }
            Transition::IsReady { .. } => {}
            Transition::Wait { h } => {
                let HState::InFlight { marker } = m.transfers[h].state else {
                    unreachable!()
                };
                m.done_seq = m.done_seq.max(marker + 1);
                m.transfers[h].state = HState::Returned;
            }
            Transition::TryWait { h } => {
                let HState::InFlight { marker } = m.transfers[h].state else {
                    unreachable!()
                };
                if marker < m.done_seq {
                    m.transfers[h].state = HState::Returned;
                }
            }
            Transition::Refill { h, salt } => {
                let b = m.transfers[h].buf;
                m.bufs[b].data = Some(distinct(m.bufs[b].len, salt));
            }
            Transition::Resubmit { h } => {
                let marker = m.queue_transfer();
                m.transfers[h].state = HState::InFlight { marker };
                m.copy(h);
            }
            Transition::IntoParts { h } | Transition::DropReturned { h } => {
                let keep = matches!(t, Transition::IntoParts { .. });
                let Transfer { buf, ten, .. } = m.transfers[h];
                m.transfers[h].state = HState::Gone;
                let place = if keep { Place::Idle } else { Place::Dropped };
                m.bufs[buf].place = place;
                m.tens[ten].place = place;
                if !keep {
                    m.next_seq += 1; // the tensor's free
                }
            }
            Transition::CopyInto { src, dst } => {
                m.next_seq += 1;
                m.tens[dst].data = m.tens[src].data.clone();
            }
            Transition::CopyFromReturned { h, dst } => {
                m.next_seq += 1;
                let src = m.returned_ten(h);
                m.tens[dst].data = m.tens[src].data.clone();
            }
            Transition::ReadTensor { .. } | Transition::ReadReturned { .. } => m.blocking(),
            Transition::CheckBuffer { .. } => {}
            Transition::DropBuffer { buf } => m.bufs[buf].place = Place::Dropped,
            Transition::DropTensor { ten } => {
                m.tens[ten].place = Place::Dropped;
                m.next_seq += 1;
            }
            Transition::Advance { ops } => {
                m.done_seq = (m.done_seq + ops as u64).min(m.next_seq);
            }
            Transition::Synchronize => {
                m.done_seq = m.next_seq;
                m.poll(false);
            }
        }
        m
    }
}

// ---------------------------------------------------------------------------------------------
// The system under test.
// ---------------------------------------------------------------------------------------------

/// A host buffer the test holds, of either kind.
enum Buf {
    Pinned(PinnedHostBuffer<f32>),
    Registered(RegisteredBuffer<f32>),
}

impl Buf {
    fn as_slice(&self) -> &[f32] {
        match self {
            Buf::Pinned(b) => b.as_slice(),
            Buf::Registered(b) => b.as_slice(),
        }
    }
}

/// What the test needs of a host buffer kind, beside what the routes need.
trait Host: HostBuffer<f32> + Sized {
    fn slice(&self) -> &[f32];
    fn slice_mut(&mut self) -> &mut [f32];
    fn buf(self) -> Buf;
    fn handle(x: Xfer<Self>) -> Handle;
}

impl Host for PinnedHostBuffer<f32> {
    fn slice(&self) -> &[f32] {
        self.as_slice()
    }
    fn slice_mut(&mut self) -> &mut [f32] {
        self.as_mut_slice()
    }
    fn buf(self) -> Buf {
        Buf::Pinned(self)
    }
    fn handle(x: Xfer<Self>) -> Handle {
        Handle::Pinned(x)
    }
}

impl Host for RegisteredBuffer<f32> {
    fn slice(&self) -> &[f32] {
        self.as_slice()
    }
    fn slice_mut(&mut self) -> &mut [f32] {
        self.as_mut_slice()
    }
    fn buf(self) -> Buf {
        Buf::Registered(self)
    }
    fn handle(x: Xfer<Self>) -> Handle {
        Handle::Registered(x)
    }
}

/// A transfer over a host buffer of kind `B`, in each direction and state.
enum Xfer<B: Host> {
    UpInFlight(Pending<Upload<f32, B>, InFlight>),
    DownInFlight(Pending<Download<f32, B>, InFlight>),
    UpReturned(Pending<Upload<f32, B>, Returned>),
    DownReturned(Pending<Download<f32, B>, Returned>),
}

enum Handle {
    Gone,
    Pinned(Xfer<PinnedHostBuffer<f32>>),
    Registered(Xfer<RegisteredBuffer<f32>>),
}

/// Runs `$body` with `$x` bound to the transfer of a live handle, whatever its buffer kind.
macro_rules! each {
    ($handle:expr_2021, $x:ident => $body:expr_2021) => {
        match $handle {
            Handle::Pinned($x) => $body,
            Handle::Registered($x) => $body,
            Handle::Gone => panic!("the transfer is gone"),
        }
    };
}

fn assert_data(what: &str, got: &[f32], expected: &Data) {
    if let Some(expected) = expected {
        assert!(
            got == expected.as_slice(),
            "{what}: got {:?}…, expected {:?}…",
            &got[..got.len().min(4)],
            &expected[..expected.len().min(4)]
        );
    }
}

fn returned<D: Operation, B: Host>(r: Pending<D, Returned>) -> Xfer<B> {
    let any: Box<dyn std::any::Any> = Box::new(r);
    match any.downcast::<Pending<Upload<f32, B>, Returned>>() {
        Ok(up) => Xfer::UpReturned(*up),
        Err(any) => Xfer::DownReturned(*any.downcast().expect("upload or download")),
    }
}

fn in_flight<D: Operation, B: Host>(p: Pending<D, InFlight>) -> Xfer<B> {
    let any: Box<dyn std::any::Any> = Box::new(p);
    match any.downcast::<Pending<Upload<f32, B>, InFlight>>() {
        Ok(up) => Xfer::UpInFlight(*up),
        Err(any) => Xfer::DownInFlight(*any.downcast().expect("upload or download")),
    }
}

fn try_wait<D: Operation, B: Host>(p: Pending<D, InFlight>, ready: bool) -> Xfer<B> {
    match p.try_wait().unwrap() {
        TryWait::Returned(r) => {
            assert!(ready, "try_wait returned before the event");
            returned(r)
        }
        TryWait::InFlight(p) => {
            assert!(!ready, "try_wait not ready after the event");
            in_flight(p)
        }
    }
}

impl<B: Host> Xfer<B> {
    fn in_flight(&self) -> bool {
        matches!(self, Xfer::UpInFlight(_) | Xfer::DownInFlight(_))
    }

    fn upload(&self) -> bool {
        matches!(self, Xfer::UpInFlight(_) | Xfer::UpReturned(_))
    }

    fn returned(&self) -> (&[f32], &DeviceTensor<f32>) {
        match self {
            Xfer::UpReturned(r) => (r.buffer().slice(), r.tensor()),
            Xfer::DownReturned(r) => (r.buffer().slice(), r.tensor()),
            _ => panic!("not a returned transfer"),
        }
    }

    fn is_ready(&mut self) -> bool {
        match self {
            Xfer::UpInFlight(p) => p.is_ready().unwrap(),
            Xfer::DownInFlight(p) => p.is_ready().unwrap(),
            _ => panic!("not in flight"),
        }
    }

    fn wait(self) -> Self {
        match self {
            Xfer::UpInFlight(p) => Xfer::UpReturned(p.wait().unwrap()),
            Xfer::DownInFlight(p) => Xfer::DownReturned(p.wait().unwrap()),
            _ => panic!("not in flight"),
        }
    }

    fn try_wait(self, ready: bool) -> Self {
        match self {
            Xfer::UpInFlight(p) => try_wait(p, ready),
            Xfer::DownInFlight(p) => try_wait(p, ready),
            _ => panic!("not in flight"),
        }
    }

    fn refill(&mut self, salt: u16) {
        let Xfer::UpReturned(r) = self else {
            panic!("not a returned upload")
        };
        let slice = r.buffer_mut().slice_mut();
        slice.copy_from_slice(&distinct(slice.len(), salt));
    }

    fn resubmit(self, engine: &mut CudaEngine) -> Self {
        match self {
            Xfer::UpReturned(r) => Xfer::UpInFlight(r.resubmit(engine).unwrap()),
            Xfer::DownReturned(r) => Xfer::DownInFlight(r.resubmit(engine).unwrap()),
            _ => panic!("not returned"),
        }
    }

    fn into_parts(self) -> (Buf, DeviceTensor<f32>) {
        let (b, t) = match self {
            Xfer::UpReturned(r) => r.into_parts(),
            // A download's parts come back source first.
            Xfer::DownReturned(r) => {
                let (t, b) = r.into_parts();
                (b, t)
            }
            _ => panic!("not returned"),
        };
        (b.buf(), t)
    }
}

fn submit<B: Host>(engine: &mut CudaEngine, upload: bool, b: B, t: DeviceTensor<f32>) -> Handle {
    B::handle(if upload {
        Xfer::UpInFlight(upload_pending(engine, b, t).unwrap())
    } else {
        Xfer::DownInFlight(download_pending(engine, t, b).unwrap())
    })
}

impl Handle {
    fn returned(&self) -> (&[f32], &DeviceTensor<f32>) {
        each!(self, x => x.returned())
    }

    fn registered(&self) -> bool {
        matches!(self, Handle::Registered(_))
    }
}

struct Sut {
    engine: CudaEngine,
    sim: SimDevice,
    bufs: Vec<Option<Buf>>,
    tens: Vec<Option<DeviceTensor<f32>>>,
    handles: Vec<Handle>,
    /// The model after the last step, for the final checks.
    model: Model,
}

impl Sut {
    fn take(&mut self, h: usize) -> Handle {
        std::mem::replace(&mut self.handles[h], Handle::Gone)
    }

    /// A transfer just came back: a download's buffer must hold what the model says.
    fn check_returned(&self, h: usize, m: &Model) {
        if let Handle::Gone = self.handles[h] {
            return;
        }
        let download = each!(&self.handles[h], x => !x.in_flight() && !x.upload());
        if download {
            let b = m.transfers[h].buf;
            assert_data(
                &format!("download {h} into buffer {b}"),
                self.handles[h].returned().0,
                &m.bufs[b].data,
            );
        }
    }
}

struct EndToEndTest;

impl StateMachineTest for EndToEndTest {
    type SystemUnderTest = Sut;
    type Reference = EndToEndModel;

    fn init_test(m: &Model) -> Sut {
        let mut engine = CudaEngine::simulated(Default::default());
        let sim = engine.sim().expect("a simulated engine");
        // As `EndToEndModel::init_state` built them.
        let bufs = m
            .bufs
            .iter()
            .map(|b| {
                let data = b.data.as_ref().unwrap();
                Some(Buf::Pinned(
                    PinnedHostBuffer::from_slice(&mut engine, data).unwrap(),
                ))
            })
            .collect();
        let tens = m
            .tens
            .iter()
            .map(|t| {
                let data = t.data.as_ref().unwrap();
                Some(upload_tensor(&mut engine, data, &[data.len()]).unwrap())
            })
            .collect();
        Sut {
            engine,
            sim,
            bufs,
            tens,
            handles: Vec::new(),
            model: m.clone(),
        }
    }

    fn apply(mut sut: Sut, m: &Model, t: Transition) -> Sut {
        let e = &mut sut.engine;
        match t {
            Transition::NewBuffer { len, salt } => sut.bufs.push(Some(Buf::Pinned(
                PinnedHostBuffer::from_slice(e, &distinct(len, salt)).unwrap(),
            ))),
            Transition::NewEmptyBuffer { len } => sut
                .bufs
                .push(Some(Buf::Pinned(PinnedHostBuffer::new(e, len).unwrap()))),
            Transition::NewRegistered { len, salt } => sut.bufs.push(Some(Buf::Registered(
                RegisteredBuffer::register(e, distinct(len, salt)).unwrap(),
            ))),
            Transition::NewTensor { len } => sut.tens.push(Some(e.alloc_tensor(&[len]).unwrap())),
            Transition::UploadTensor { len, salt } => sut.tens.push(Some(
                upload_tensor(e, &distinct(len, salt), &[len]).unwrap(),
            )),
            Transition::Upload { buf, ten } | Transition::Download { ten, buf } => {
                let upload = matches!(t, Transition::Upload { .. });
                let b = sut.bufs[buf].take().unwrap();
                let t = sut.tens[ten].take().unwrap();
                sut.handles.push(match b {
                    Buf::Pinned(b) => submit(e, upload, b, t),
                    Buf::Registered(b) => submit(e, upload, b, t),
                });
            }
            Transition::IsReady { h } => {
                let HState::InFlight { marker } = m.transfers[h].state else {
                    panic!("model transfer {h} is not in flight")
                };
                let expected = marker < m.done_seq;
                let got = each!(&mut sut.handles[h], x => x.is_ready());
                assert_eq!(got, expected, "is_ready of transfer {h}");
            }
            Transition::Wait { h } => {
                sut.handles[h] = match sut.take(h) {
                    Handle::Pinned(x) => Handle::Pinned(x.wait()),
                    Handle::Registered(x) => Handle::Registered(x.wait()),
                    Handle::Gone => panic!("transfer {h} is gone"),
                };
                sut.check_returned(h, m);
            }
            Transition::TryWait { h } => {
                let ready = is_returned(&m.transfers[h]);
                sut.handles[h] = match sut.take(h) {
                    Handle::Pinned(x) => Handle::Pinned(x.try_wait(ready)),
                    Handle::Registered(x) => Handle::Registered(x.try_wait(ready)),
                    Handle::Gone => panic!("transfer {h} is gone"),
                };
                sut.check_returned(h, m);
            }
            Transition::Refill { h, salt } => each!(&mut sut.handles[h], x => x.refill(salt)),
            Transition::Resubmit { h } => {
                sut.handles[h] = match std::mem::replace(&mut sut.handles[h], Handle::Gone) {
                    Handle::Pinned(x) => Handle::Pinned(x.resubmit(e)),
                    Handle::Registered(x) => Handle::Registered(x.resubmit(e)),
                    Handle::Gone => panic!("transfer {h} is gone"),
                };
            }
            Transition::IntoParts { h } => {
                let handle = std::mem::replace(&mut sut.handles[h], Handle::Gone);
                let (b, t) = each!(handle, x => x.into_parts());
                let Transfer { buf, ten, .. } = m.transfers[h];
                sut.bufs[buf] = Some(b);
                sut.tens[ten] = Some(t);
            }
            Transition::Detach { h } => {
                let handle = sut.take(h);
                assert!(each!(&handle, x => x.in_flight()));
                drop(handle);
            }
            Transition::Forget { h } => {
                let handle = sut.take(h);
                assert!(handle.registered() && each!(&handle, x => x.in_flight()));
                std::mem::forget(handle);
            }
            Transition::DropReturned { h } => {
                let handle = sut.take(h);
                assert!(!each!(&handle, x => x.in_flight()));
                drop(handle);
            }
            Transition::CopyInto { src, dst } => {
                let mut d = sut.tens[dst].take().unwrap();
                e.copy_into(sut.tens[src].as_ref().unwrap(), &mut d)
                    .unwrap();
                sut.tens[dst] = Some(d);
            }
            Transition::CopyFromReturned { h, dst } => {
                let d = sut.tens[dst].as_mut().unwrap();
                e.copy_into(sut.handles[h].returned().1, d).unwrap();
            }
            Transition::ReadTensor { ten } => {
                let got = download_tensor(e, sut.tens[ten].as_ref().unwrap()).unwrap();
                assert_data(&format!("tensor {ten}"), &got, &m.tens[ten].data);
            }
            Transition::ReadReturned { h } => {
                let got = download_tensor(e, sut.handles[h].returned().1).unwrap();
                let ten = m.transfers[h].ten;
                assert_data(
                    &format!("tensor {ten} of transfer {h}"),
                    &got,
                    &m.tens[ten].data,
                );
            }
            Transition::CheckBuffer { buf } => assert_data(
                &format!("buffer {buf}"),
                sut.bufs[buf].as_ref().unwrap().as_slice(),
                &m.bufs[buf].data,
            ),
            Transition::IntoVec { buf } => {
                let Some(Buf::Registered(b)) = sut.bufs[buf].take() else {
                    panic!("buffer {buf} is not an idle registered buffer")
                };
                let start = b.as_slice().as_ptr();
                let back = b.into_vec().unwrap();
                assert_eq!(
                    back.as_ptr(),
                    start,
                    "into_vec gives the same allocation back"
                );
                assert_data(&format!("Vec of buffer {buf}"), &back, &m.bufs[buf].data);
            }
            Transition::ForgetBuffer { buf } => {
                let Some(Buf::Registered(b)) = sut.bufs[buf].take() else {
                    panic!("buffer {buf} is not an idle registered buffer")
                };
                std::mem::forget(b);
            }
            Transition::DropBuffer { buf } => drop(sut.bufs[buf].take().unwrap()),
            Transition::DropTensor { ten } => drop(sut.tens[ten].take().unwrap()),
            Transition::Advance { ops } => {
                let queued = sut.sim.queued();
                assert_eq!(sut.sim.advance(ops), ops.min(queued));
            }
            Transition::Synchronize => e.synchronize().unwrap(),
        }
        if matches!(
            t,
            Transition::UploadTensor { .. }
                | Transition::ReadTensor { .. }
                | Transition::ReadReturned { .. }
        ) {
            // A blocking route proves only its own stream (and what that stream waited for);
            // this model keeps one device clock, so the device runs to its end here, as it does
            // in the model. The order across streams is `model_duplex`'s to check.
            sut.sim.advance_all();
        }
        sut.model = m.clone();
        sut
    }

    fn check_invariants(sut: &Sut, m: &Model) {
        assert_eq!(sut.sim.violations(), Vec::<Violation>::new());
        assert_eq!(
            sut.sim.queued() as u64,
            m.next_seq - m.done_seq,
            "device clock"
        );
        for (h, t) in m.transfers.iter().enumerate() {
            let ok = match (&sut.handles[h], t.state) {
                (Handle::Gone, HState::Gone) => true,
                (Handle::Gone, _) | (_, HState::Gone) => false,
                (handle, state) => {
                    let (in_flight, upload) = each!(handle, x => (x.in_flight(), x.upload()));
                    in_flight == matches!(state, HState::InFlight { .. })
                        && upload == (t.dir == Dir::Up)
                        && handle.registered() == m.bufs[t.buf].registered
                }
            };
            assert!(ok, "transfer {h} is not in the model's state {t:?}");
        }
        for (b, buf) in m.bufs.iter().enumerate() {
            let held = &sut.bufs[b];
            match buf.place {
                Place::Idle => assert_eq!(
                    held.as_ref().map(|h| matches!(h, Buf::Registered(_))),
                    Some(buf.registered),
                    "buffer {b}"
                ),
                _ => assert!(held.is_none(), "buffer {b} is not held"),
            }
        }
        let stats = sut.engine.retirement_stats();
        assert_eq!(
            (stats.pending, stats.retained),
            (m.retire.len(), 0),
            "retirement queue"
        );
    }

    fn teardown(mut sut: Sut) {
        // Every transfer comes back, every download holds the model's data, and every tensor
        // holds the model's data.
        let m = sut.model.clone();
        for h in 0..sut.handles.len() {
            sut.handles[h] = match sut.take(h) {
                Handle::Pinned(x) if x.in_flight() => Handle::Pinned(x.wait()),
                Handle::Registered(x) if x.in_flight() => Handle::Registered(x.wait()),
                other => other,
            };
            sut.check_returned(h, &m);
            if !matches!(sut.handles[h], Handle::Gone) {
                let ten = m.transfers[h].ten;
                let got = download_tensor(&mut sut.engine, sut.handles[h].returned().1).unwrap();
                assert_data(&format!("tensor {ten}"), &got, &m.tens[ten].data);
            }
        }
        for (ten, t) in sut.tens.iter().enumerate() {
            if let Some(t) = t {
                let got = download_tensor(&mut sut.engine, t).unwrap();
                assert_data(&format!("tensor {ten}"), &got, &m.tens[ten].data);
            }
        }
        let Sut {
            engine,
            sim,
            bufs,
            tens,
            handles,
            ..
        } = sut;
        drop((handles, bufs, tens));
        drop(engine);
        // Frees of tensors released by the teardown itself are queued after its final wait.
        sim.advance_all();
        assert_eq!(sim.violations(), Vec::<Violation>::new());
        assert_eq!(sim.pinned_live(), (0, 0), "every pinned block freed");
        // Only what was forgotten stays: registered buffers never unregistered, and the tensors
        // of forgotten transfers.
        let forgotten = |objs: &[Obj]| {
            let leaked: Vec<&Obj> = objs
                .iter()
                .filter(|o| o.place == Place::Forgotten)
                .collect();
            (
                leaked.len(),
                leaked.iter().map(|o| o.len * 4).sum::<usize>(),
            )
        };
        assert_eq!(
            sim.registered_live(),
            forgotten(&m.bufs),
            "every registered buffer unregistered but the forgotten ones"
        );
        assert_eq!(
            sim.device_live(),
            forgotten(&m.tens),
            "every tensor freed but those of forgotten transfers"
        );
    }
}

prop_state_machine! {
    #![proptest_config(Config {
        cases: 128,
        failure_persistence: None,
        ..Config::default()
    })]

    #[test]
    fn transfers_carry_the_model_data(sequential 1..30 => EndToEndTest);
}
