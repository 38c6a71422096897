//! The cudarc-free core of the interop on the simulated device: lends and adoptions between an
//! engine and another simulated engine's compute stream, which stands for the cudarc stream
//! (the simulator accepts another engine's stream as a foreign one), under every interleaving
//! of the streams the race checker sees. The other library's handle on lent memory is a tensor
//! of the other engine over it that releases nothing ([`Viewed`]); the owner of adopted memory
//! is a tensor of the other engine, freed on its compute stream as a `CudaSlice` is on its own.

use super::adopt::adopt;
use super::lend::Lending;
use crate::core::engine::{CudaEngine, Shared};
use crate::core::order::Use;
use crate::driver::DevicePtr;
use crate::driver::sim::{Schedule, SimConfig, SimDevice, SimOp};
use crate::error::{DriverError, Error, SubmitError, UsageError};
use crate::memory::element::Element;
use crate::memory::tensor::{DeviceTensor, Home};
use crate::{download_tensor, upload_tensor, upload_tensor_into};
use std::sync::Arc;

const N: usize = 4096;

// Lends move between threads like the tensors they borrow (their drop orders from any thread).
static_assertions::assert_impl_all!(super::Lent<'static, f32>: Send, Sync);
static_assertions::assert_impl_all!(super::LentMut<'static, f32>: Send, Sync);

/// A machine of one device, with `seed`'s interleaving when given.
fn machine(seed: Option<u64>) -> SimDevice {
    let sim = SimDevice::new(SimConfig::default());
    if let Some(seed) = seed {
        sim.set_schedule(Schedule::Interleaved { seed });
    }
    sim
}

/// The engine, and the other library (its compute stream is the foreign stream).
fn engines(sim: &SimDevice) -> (CudaEngine, CudaEngine) {
    (CudaEngine::simulated_on(sim), CudaEngine::simulated_on(sim))
}

/// `engine`'s compute stream, as the foreign stream handle the simulator takes.
fn stream_of(engine: &CudaEngine) -> u64 {
    engine.shared.lock().driver.stream_handle()
}

fn data() -> Vec<f32> {
    (0..N).map(|i| i as f32 + 1.0).collect()
}

/// The home of a view of memory another engine owns: its drop releases nothing.
struct Viewed;

impl Home for Viewed {
    fn drop_memory(&self, _: &Arc<Shared>, _: DevicePtr) {}
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The other library's handle on lent memory: a tensor of `other` over `ptr`, `N` elements of
/// `T`, whose drop releases nothing.
fn view_on<T: Element>(other: &CudaEngine, ptr: DevicePtr) -> DeviceTensor<T> {
    // SAFETY: `ptr` is a live allocation of the machine's one device of `N` elements of `T`,
    // lent to `other`'s stream; the tests queue work on the view only while the lend lasts.
    unsafe { DeviceTensor::homed(ptr, &[N], N, &other.shared, Arc::new(Viewed)) }
}

/// Checks `got` against `want`, naming the first element that differs (not all of them).
fn check(got: &[f32], want: &[f32], seed: u64) {
    assert_eq!(got.len(), want.len(), "seed {seed}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!("seed {seed}: element {i} is {}, not {}", got[i], want[i]);
    }
}

/// Tears both engines down, runs what is left, and checks the device saw nothing go wrong;
/// returns how many allocations are still live.
fn finish(sim: &SimDevice, engines: (CudaEngine, CudaEngine), seed: u64) -> usize {
    drop(engines);
    settled(sim, seed)
}

/// Runs the device to the end, asserts it saw no rule broken, and returns how many allocations
/// are left.
fn settled(sim: &SimDevice, seed: u64) -> usize {
    sim.advance_all();
    assert!(
        sim.violations().is_empty(),
        "seed {seed}: {:?}",
        sim.violations()
    );
    sim.device_live().0
}

// Lends.

/// A shared lend: the other stream reads what the engine's upload wrote, and the engine's later
/// writes (an upload, on another lane than the take-back's, then a kernel) wait for that read,
/// whatever order the streams run in.
#[test]
fn a_shared_lend_orders_the_engines_later_writes_after_the_other_streams_read() {
    for seed in 0..32 {
        let sim = machine(Some(seed));
        let (mut a, mut b) = engines(&sim);
        let data = data();
        let mut x = upload_tensor(&mut a, &data, &[N]).unwrap();
        // SAFETY: `b`'s compute stream, live as long as `b`, which outlives the lend.
        let lending = unsafe { Lending::begin(&mut a, &mut x, stream_of(&b), false) }.unwrap();
        let view = view_on::<f32>(&b, lending.ptr());
        let seen = b.scale(&view, 2.0).unwrap();
        drop(view);
        drop(lending);
        upload_tensor_into(&mut a, &mut x, &vec![-1.0f32; N]).unwrap();
        a.fill(&mut x, -2.0).unwrap();
        let doubled: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
        check(&download_tensor(&mut b, &seen).unwrap(), &doubled, seed);
        check(&download_tensor(&mut a, &x).unwrap(), &[-2.0; N], seed);
        drop((x, seen));
        assert_eq!(finish(&sim, (a, b), seed), 0, "seed {seed}");
    }
}

/// A mutable lend: the other stream's write waits for the engine's earlier write (an upload)
/// and read (a kernel), and the engine's later read (a download, on another lane) sees it,
/// whatever order the streams run in.
#[test]
fn a_mutable_lend_orders_the_other_streams_write_between_the_engines_uses() {
    for seed in 0..32 {
        let sim = machine(Some(seed));
        let (mut a, mut b) = engines(&sim);
        let data = data();
        let mut x = upload_tensor(&mut a, &data, &[N]).unwrap();
        let tripled = a.scale(&x, 3.0).unwrap();
        // SAFETY: as above.
        let lending = unsafe { Lending::begin(&mut a, &mut x, stream_of(&b), true) }.unwrap();
        let mut view = view_on::<f32>(&b, lending.ptr());
        b.fill(&mut view, 5.0).unwrap();
        drop(view);
        drop(lending);
        check(&download_tensor(&mut a, &x).unwrap(), &[5.0; N], seed);
        let want: Vec<f32> = data.iter().map(|v| v * 3.0).collect();
        check(&download_tensor(&mut a, &tripled).unwrap(), &want, seed);
        drop((x, tripled));
        assert_eq!(finish(&sim, (a, b), seed), 0, "seed {seed}");
    }
}

/// The control of the first test: a hand-over with no take-back lets the engine's write
/// overtake the other stream's read under some interleaving, which the race checker reports.
/// (The lend's take-back is what the tests above prove needed.)
#[test]
fn without_the_take_back_the_engines_write_races_the_other_streams_read() {
    let mut raced = 0;
    for seed in 0..32 {
        let sim = machine(Some(seed));
        let (mut a, mut b) = engines(&sim);
        let mut x = upload_tensor(&mut a, &data(), &[N]).unwrap();
        let ptr = x.raw_ptr();
        {
            let mut st = a.enter().unwrap();
            let st = &mut *st;
            // SAFETY: `b`'s compute stream, live as long as `b`.
            unsafe {
                st.order
                    .hand_over(&mut *st.driver, stream_of(&b), &[Use::Read(ptr)])
            }
            .unwrap();
        }
        let view = view_on::<f32>(&b, ptr);
        let seen = b.scale(&view, 2.0).unwrap();
        drop(view);
        a.fill(&mut x, -2.0).unwrap();
        a.synchronize().unwrap();
        b.synchronize().unwrap();
        drop((x, seen, a, b));
        sim.advance_all();
        raced += usize::from(!sim.violations().is_empty());
    }
    assert!(
        raced > 0,
        "no interleaving of 32 let the write overtake the read"
    );
}

/// A forgotten lend leaves the tensor empty, usable by the engine, and the memory leaked: the
/// engine never touches it under the other stream's write.
#[test]
fn a_forgotten_lend_leaves_the_tensor_empty_and_leaks_its_memory() {
    let sim = machine(Some(7));
    let (mut a, mut b) = engines(&sim);
    let mut x = upload_tensor(&mut a, &data(), &[N]).unwrap();
    // SAFETY: as above.
    let lending = unsafe { Lending::begin(&mut a, &mut x, stream_of(&b), true) }.unwrap();
    let mut view = view_on::<f32>(&b, lending.ptr());
    b.fill(&mut view, 5.0).unwrap();
    drop(view);
    std::mem::forget(lending);
    assert_eq!((x.len(), x.shape()), (0, &[0][..]));
    a.fill(&mut x, 1.0).unwrap();
    assert_eq!(download_tensor(&mut a, &x).unwrap(), Vec::<f32>::new());
    a.synchronize().unwrap();
    drop(x);
    assert_eq!(finish(&sim, (a, b), 7), 1, "the lent memory is leaked");
}

/// Another engine's tensor is refused before anything is queued, and keeps its memory.
#[test]
fn a_lend_of_another_engines_tensor_is_refused_and_the_tensor_kept() {
    let sim = machine(None);
    let (mut a, mut b) = engines(&sim);
    let mut theirs = upload_tensor(&mut b, &data(), &[N]).unwrap();
    let stream = stream_of(&b);
    // SAFETY: as above.
    let refused = unsafe { Lending::begin(&mut a, &mut theirs, stream, false) };
    assert!(matches!(
        refused.err(),
        Some(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    check(&download_tensor(&mut b, &theirs).unwrap(), &data(), 0);
    drop(theirs);
    assert_eq!(finish(&sim, (a, b), 0), 0);
}

/// A lend whose wait cannot be queued is refused, and the tensor keeps its memory.
#[test]
fn a_lend_whose_wait_is_refused_keeps_the_tensor() {
    let sim = machine(None);
    let (mut a, b) = engines(&sim);
    let mut x = a.full::<f32>(&[N], 4.0).unwrap();
    sim.fail_nth(SimOp::StreamWait, 1, DriverError::INVALID_HANDLE);
    // SAFETY: as above.
    let refused = unsafe { Lending::begin(&mut a, &mut x, stream_of(&b), true) };
    assert!(matches!(refused.err(), Some(Error::Driver { .. })));
    check(&download_tensor(&mut a, &x).unwrap(), &[4.0; N], 0);
    drop(x);
    assert_eq!(finish(&sim, (a, b), 0), 0);
}

/// A lend whose end cannot be ordered (the engine's wait refused) leaks the memory and leaves
/// the tensor empty; the failure is reported at the next boundary.
#[test]
fn a_lend_whose_end_cannot_be_ordered_leaks_the_memory() {
    let sim = machine(Some(3));
    let (mut a, mut b) = engines(&sim);
    let mut x = upload_tensor(&mut a, &data(), &[N]).unwrap();
    // SAFETY: as above.
    let lending = unsafe { Lending::begin(&mut a, &mut x, stream_of(&b), true) }.unwrap();
    let mut view = view_on::<f32>(&b, lending.ptr());
    b.fill(&mut view, 5.0).unwrap();
    drop(view);
    sim.fail_nth(SimOp::StreamWait, 1, DriverError::INVALID_HANDLE);
    drop(lending);
    assert!(x.is_empty());
    assert!(matches!(a.flush(), Err(Error::Deferred { .. })));
    drop(x);
    assert_eq!(finish(&sim, (a, b), 3), 1, "the lent memory is leaked");
}

/// A lend that ends after its engine was dropped still orders the tensor's free after the
/// other stream's work, and puts the memory back for it.
#[test]
fn a_lend_that_ends_after_its_engine_still_orders_the_free() {
    for seed in 0..8 {
        let sim = machine(Some(seed));
        let (mut a, mut b) = engines(&sim);
        let mut x = upload_tensor(&mut a, &data(), &[N]).unwrap();
        // SAFETY: as above.
        let lending = unsafe { Lending::begin(&mut a, &mut x, stream_of(&b), true) }.unwrap();
        let mut view = view_on::<f32>(&b, lending.ptr());
        b.fill(&mut view, 5.0).unwrap();
        drop(view);
        drop(a);
        drop(lending);
        assert_eq!(x.len(), N, "seed {seed}");
        drop(x);
        b.synchronize().unwrap();
        drop(b);
        assert_eq!(settled(&sim, seed), 0, "seed {seed}");
    }
}

// Adoptions.

/// The owner's memory (written on its stream by a kernel) as the engine's tensor: the engine's
/// read waits for that write, and the owner's free (on its stream) for the engine's later
/// write, whatever order the streams run in.
#[test]
fn an_adopted_allocation_is_read_after_its_owners_write_and_freed_after_the_engines_uses() {
    for seed in 0..32 {
        let sim = machine(Some(seed));
        let (mut a, mut b) = engines(&sim);
        let data = data();
        let source = upload_tensor(&mut b, &data, &[N]).unwrap();
        let owner = b.scale(&source, 2.0).unwrap();
        let (ptr, len) = (owner.raw_ptr(), owner.len());
        let mut t =
            // SAFETY: `owner` holds `len` f32 at `ptr`, written on `b`'s compute stream, and frees
            // them there (its only unproven lane) when dropped; `b` outlives it.
            unsafe { adopt::<f32, _>(&mut a, owner, ptr, len, &[64, 64], stream_of(&b), "test") }
                .unwrap();
        assert_eq!(t.shape(), [64, 64]);
        let sixfold = a.scale(&t, 3.0).unwrap();
        a.fill(&mut t, -1.0).unwrap();
        drop(t);
        let want: Vec<f32> = data.iter().map(|v| v * 6.0).collect();
        check(&download_tensor(&mut a, &sixfold).unwrap(), &want, seed);
        drop((source, sixfold));
        assert_eq!(finish(&sim, (a, b), seed), 0, "seed {seed}");
    }
}

/// A shape that does not hold the owner's elements is refused, the owner handed back.
#[test]
fn an_adoption_with_the_wrong_length_hands_the_owner_back() {
    let sim = machine(None);
    let (mut a, mut b) = engines(&sim);
    let owner = upload_tensor(&mut b, &data(), &[N]).unwrap();
    let (ptr, len) = (owner.raw_ptr(), owner.len());
    // SAFETY: as above.
    let refused = unsafe { adopt::<f32, _>(&mut a, owner, ptr, len, &[N + 1], stream_of(&b), "t") };
    let Err(SubmitError::Rejected { input, error }) = refused else {
        panic!("expected a refusal");
    };
    assert!(matches!(
        error,
        Error::Usage(UsageError::LengthMismatch {
            expected,
            found: N,
            ..
        }) if expected == N + 1
    ));
    check(&download_tensor(&mut b, &input).unwrap(), &data(), 0);
    drop(input);
    assert_eq!(finish(&sim, (a, b), 0), 0);
}

/// An adoption whose wait cannot be queued fails, the owner handed back.
#[test]
fn an_adoption_whose_wait_is_refused_hands_the_owner_back() {
    let sim = machine(None);
    let (mut a, mut b) = engines(&sim);
    let owner = b.full::<f32>(&[N], 4.0).unwrap();
    let (ptr, len) = (owner.raw_ptr(), owner.len());
    sim.fail_nth(SimOp::StreamWait, 1, DriverError::INVALID_HANDLE);
    // SAFETY: as above.
    let failed = unsafe { adopt::<f32, _>(&mut a, owner, ptr, len, &[N], stream_of(&b), "t") };
    let Err(SubmitError::Failed { input, .. }) = failed else {
        panic!("expected a failure");
    };
    check(&download_tensor(&mut b, &input).unwrap(), &[4.0; N], 0);
    drop(input);
    assert_eq!(finish(&sim, (a, b), 0), 0);
}

/// A zero-element adoption drops the owner at once and gives an empty tensor.
#[test]
fn a_zero_element_adoption_releases_the_owner_at_once() {
    let sim = machine(None);
    let (mut a, mut b) = engines(&sim);
    let owner = b.alloc_tensor::<f32>(&[0]).unwrap();
    let stream = stream_of(&b);
    // SAFETY: as above (an empty tensor owns nothing).
    let t = unsafe { adopt::<f32, _>(&mut a, owner, 0, 0, &[2, 0], stream, "t") }.unwrap();
    assert_eq!((t.len(), t.shape()), (0, &[2, 0][..]));
    drop(t);
    assert_eq!(finish(&sim, (a, b), 0), 0);
}

/// An adopted tensor dropped after its engine still orders the owner's free after the
/// engine's uses.
#[test]
fn an_adopted_tensor_dropped_after_its_engine_still_orders_the_free() {
    for seed in 0..8 {
        let sim = machine(Some(seed));
        let (mut a, mut b) = engines(&sim);
        let owner = b.full::<f32>(&[N], 4.0).unwrap();
        let (ptr, len) = (owner.raw_ptr(), owner.len());
        let mut t =
            // SAFETY: as above.
            unsafe { adopt::<f32, _>(&mut a, owner, ptr, len, &[N], stream_of(&b), "t") }.unwrap();
        a.fill(&mut t, 1.0).unwrap();
        drop(a);
        drop(t);
        b.synchronize().unwrap();
        drop(b);
        assert_eq!(settled(&sim, seed), 0, "seed {seed}");
    }
}

/// An adopted tensor whose drop cannot order the owner's stream after the engine leaks the
/// owner (its memory is never freed under the engine's work); the failure is reported.
#[test]
fn an_adopted_tensor_whose_hand_over_is_refused_leaks_its_owner() {
    let sim = machine(Some(5));
    let (mut a, mut b) = engines(&sim);
    let owner = b.full::<f32>(&[N], 4.0).unwrap();
    let (ptr, len) = (owner.raw_ptr(), owner.len());
    let mut t =
        // SAFETY: as above.
        unsafe { adopt::<f32, _>(&mut a, owner, ptr, len, &[N], stream_of(&b), "t") }.unwrap();
    a.fill(&mut t, 1.0).unwrap();
    sim.fail_nth(SimOp::StreamWait, 1, DriverError::INVALID_HANDLE);
    drop(t);
    assert!(matches!(a.flush(), Err(Error::Deferred { .. })));
    assert_eq!(finish(&sim, (a, b), 5), 1, "the owner's memory is leaked");
}
