//! `DeviceTensor<T>`: a compact, shaped device allocation owned by one engine.
//!
//! A tensor is allocated stream-ordered on one of its engine's streams from the engine's memory
//! pool, and freed the same way when dropped (after an event wait for its uses on the engine's
//! other streams), so its memory is reused by later work without a host barrier and is never
//! released while earlier queued work still uses it.
//! Copying is explicit ([`CudaEngine::copy_tensor`], [`CudaEngine::copy_into`]): a queued
//! device-to-device copy, never an implicit clone.

use super::element::{Element, byte_len};
use super::pressure::Memory;
use crate::core::engine::{Charge, CudaEngine, Shared, State};
use crate::core::order::Use;
use crate::core::retire::Held;
use crate::device::{DeviceId, DeviceMemory};
use crate::driver::{DevicePtr, Lane};
use crate::dtype::DType;
use crate::error::{Error, OutOfMemory, Result, SubmitError, UsageError};
use crate::ledger::Owner;
use std::marker::PhantomData;
use std::panic::Location;
use std::sync::Arc;
use std::sync::Mutex;

/// A tensor's shape: up to [`Shape::INLINE`] dimensions held in place (no allocation: an
/// allocation and a free of a tensor then cost no host heap call), more on the heap.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Shape {
    Inline {
        dims: [usize; Shape::INLINE],
        rank: u8,
    },
    Heap(Box<[usize]>),
}

impl Shape {
    /// The most dimensions held in place.
    const INLINE: usize = 4;

    pub(crate) fn new(shape: &[usize]) -> Self {
        if shape.len() <= Self::INLINE {
            let mut dims = [0; Self::INLINE];
            dims[..shape.len()].copy_from_slice(shape);
            Shape::Inline {
                dims,
                rank: shape.len() as u8,
            }
        } else {
            Shape::Heap(shape.into())
        }
    }
}

impl Default for Shape {
    fn default() -> Self {
        Shape::new(&[])
    }
}

impl std::ops::Deref for Shape {
    type Target = [usize];

    fn deref(&self) -> &[usize] {
        match self {
            Shape::Inline { dims, rank } => &dims[..usize::from(*rank)],
            Shape::Heap(dims) => dims,
        }
    }
}

/// A compact, shaped tensor of `T` in device memory, owned by one engine.
///
/// The element count is the product of the shape (an empty shape is a scalar: one element).
/// Dropping it frees its memory stream-ordered, after every queued operation that uses it.
pub struct DeviceTensor<T: Element> {
    ptr: DevicePtr,
    len: usize,
    shape: Shape,
    owner: Arc<Shared>,
    /// Where the memory goes when the tensor is dropped, instead of the driver, if anywhere.
    recycle: Option<Arc<Recycler>>,
    /// Who takes the memory when the tensor is dropped, when it is shared with other processes
    /// (exported, or another process's and imported): instead of the driver's free.
    home: Option<Arc<dyn Home>>,
    _element: PhantomData<T>,
}

/// Device blocks handed back by dropped tensors for reuse on the same engine, without a
/// stream-ordered free and allocation in between.
///
/// Reusing a block is exactly as safe as a free and an allocation: the block keeps its uses in
/// the engine's lane order (it is not forgotten, as a freed block is), so the next write of it
/// waits for every earlier use on another lane, and work on the same lane runs in order. A recycler holds at most `capacity` blocks; beyond that a
/// dropped tensor frees its memory as usual. Once closed ([`Recycler::close`]) it takes nothing
/// more, and its owner frees what it held.
pub(crate) struct Recycler {
    /// `None` once closed; else the blocks, as (bytes, address).
    blocks: Mutex<Option<Vec<(usize, DevicePtr)>>>,
    capacity: usize,
}

impl Recycler {
    /// An open recycler holding up to `capacity` blocks.
    pub(crate) fn new(capacity: usize) -> Self {
        Recycler {
            blocks: Mutex::new(Some(Vec::with_capacity(capacity))),
            capacity,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<(usize, DevicePtr)>>> {
        // Every critical section is a push, a removal or a take: never half done.
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A block of exactly `bytes`, if one was handed back.
    pub(crate) fn take(&self, bytes: usize) -> Option<DevicePtr> {
        let mut blocks = self.lock();
        let blocks = blocks.as_mut()?;
        let at = blocks.iter().position(|&(b, _)| b == bytes)?;
        Some(blocks.swap_remove(at).1)
    }

    /// Keeps `ptr` (`bytes` long) for reuse; `false` when closed or full (the caller frees it).
    fn put(&self, bytes: usize, ptr: DevicePtr) -> bool {
        let mut blocks = self.lock();
        match blocks.as_mut() {
            Some(blocks) if blocks.len() < self.capacity => {
                blocks.push((bytes, ptr));
                true
            }
            _ => false,
        }
    }

    /// Closes the recycler and returns the blocks it held (their bytes and addresses), for the
    /// owner to free.
    pub(crate) fn close(&self) -> Vec<(usize, DevicePtr)> {
        self.lock().take().unwrap_or_default()
    }
}

/// A tensor's memory taken out of it ([`DeviceTensor::take_memory`]) while another library's
/// stream may use it. It releases nothing when dropped: it goes back into its tensor
/// ([`DeviceTensor::restore_memory`]) once the other stream's work is ordered before the
/// engine's, and is otherwise dropped or forgotten, the memory leaked.
pub(crate) struct Taken {
    ptr: DevicePtr,
    len: usize,
    shape: Shape,
    recycle: Option<Arc<Recycler>>,
    home: Option<Arc<dyn Home>>,
}

impl Drop for Taken {
    fn drop(&mut self) {
        // Not put back: the memory is leaked, and its home with it (a home's drop may release
        // the memory, under work that may still use it).
        if let Some(home) = self.home.take() {
            std::mem::forget(home);
        }
    }
}

impl Taken {
    /// The memory's device address (0 for an empty tensor).
    pub(crate) fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The element count.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The tensor's shape.
    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// Where a tensor's memory goes when it is dropped, when other processes share it: memory this
/// engine exported (freed only once every importer has unmapped it) or memory another process
/// exported (released, and its exporter told, instead of freed).
pub(crate) trait Home: Send + Sync + std::any::Any {
    /// Takes the memory at `ptr`, of the engine `owner`, from a tensor being dropped. Never
    /// frees it under work of this process or another that may still use it; what cannot be
    /// proven done is leaked.
    fn drop_memory(&self, owner: &Arc<Shared>, ptr: DevicePtr);
    /// The home as `Any`, for the route that made it to know it again.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: Element> std::fmt::Debug for DeviceTensor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("dtype", &T::DTYPE)
            .field("shape", &&*self.shape)
            .field("device", &self.owner.device)
            .finish()
    }
}

/// The element count a shape describes: the product of its dimensions (one for the empty shape).
///
/// A shape with a zero dimension holds no elements, whatever its other dimensions are. Any other
/// shape is checked on its full product, so the order of the dimensions never matters.
pub(crate) fn shape_len(shape: &[usize]) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            Error::Usage(UsageError::ShapeOverflow {
                shape: shape.to_vec(),
            })
        })
}

/// Allocates `bytes` of device memory ordered on `lane`, and records the allocation (work on
/// another lane that writes or frees it waits for it: the pool may hand out memory whose
/// previous user on that lane has not finished). When the driver reports
/// out-of-memory, everything the retirement queue has proven complete is released first (its
/// device memory frees, stream-ordered, once the lock is released) and the allocation is tried
/// once more (`memory::pressure`); then the pool gives its unused memory back to the device
/// (what it keeps for reuse may be split too finely to serve the size) and it is tried once
/// more. What fails then is [`Error::OutOfMemory`], saying where the memory is.
#[track_caller]
pub(crate) fn alloc_device(
    shared: &Shared,
    lane: Lane,
    bytes: usize,
    owner: Owner,
) -> Result<DevicePtr> {
    let at = Location::caller();
    let attempt = |st: &mut State, _| {
        st.alloc_at(lane, bytes, owner, at)
            .map_err(Error::driver("cuMemAllocFromPoolAsync"))
    };
    match shared.allocate(Memory::Device, attempt) {
        Ok((_st, ptr)) => Ok(ptr),
        Err(error) if crate::memory::pressure::out_of_memory(&error) => {
            let mut st = shared.enter()?;
            // A refused trim changes nothing: the retry below fails as the first did.
            let _ = st.driver.trim_pool(0);
            match attempt(&mut st, true) {
                Err(error) if crate::memory::pressure::out_of_memory(&error) => {
                    // A failed allocation may leave the pool holding what it reserved for
                    // it (CUDA's does): given back, so the report says where the memory was.
                    let _ = st.driver.trim_pool(0);
                    Err(Error::OutOfMemory(Box::new(
                        st.out_of_memory(shared, bytes),
                    )))
                }
                made => made,
            }
        }
        Err(error) => Err(error),
    }
}

impl State {
    /// Why an allocation of `asked` bytes found no memory: the device's and the pool's figures
    /// now, the retired work still waiting for its proof, what the engine holds by owner, and
    /// the allocation history when it is kept.
    fn out_of_memory(&mut self, shared: &Shared, asked: usize) -> OutOfMemory {
        let report = shared.waits.memory_report().ok();
        let memory = report.map(device_memory);
        let mut held = shared.cells.read();
        held.device = memory;
        OutOfMemory {
            asked,
            memory,
            waiting: self.retire.stats().pending,
            largest: report.and_then(|r| r.largest),
            held,
            history: self.ledger.history(),
        }
    }
}

/// The public figures of a driver's report.
pub(crate) fn device_memory(report: crate::driver::MemoryReport) -> DeviceMemory {
    DeviceMemory {
        free: report.free,
        total: report.total,
        pool_reserved: report.reserved,
        pool_in_use: report.used,
    }
}

impl CudaEngine {
    /// The device's free and total memory (`cuMemGetInfo`) and what this engine's memory pool
    /// holds of it: in use, and kept for reuse ([`DeviceMemory`]). A free does not give memory
    /// back to the device: the pool keeps it, so that the next allocation of the same size
    /// costs no driver call; [`trim_device_pool`](Self::trim_device_pool) gives it back.
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver cannot report it.
    pub fn device_memory(&self) -> Result<DeviceMemory> {
        let report = self
            .shared
            .waits
            .memory_report()
            .map_err(|source| Error::Driver {
                call: "cuMemGetInfo",
                source,
            })?;
        Ok(device_memory(report))
    }

    /// Gives the memory this engine's pool keeps unused back to the device, down to `keep`
    /// bytes (`cuMemPoolTrimTo`), for other processes or other pools to use. Memory in a live
    /// tensor, or whose free is still queued behind work, stays. An allocation that finds no
    /// memory does this itself before it fails.
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver refuses.
    pub fn trim_device_pool(&mut self, keep: usize) -> Result<()> {
        let mut st = self.enter()?;
        st.driver.trim_pool(keep).map_err(|source| Error::Driver {
            call: "cuMemPoolTrimTo",
            source,
        })
    }
}

impl<T: Element> DeviceTensor<T> {
    /// Allocates an uninitialised tensor on `engine`'s compute lane. A zero-element tensor
    /// allocates nothing.
    #[track_caller]
    pub(crate) fn alloc(engine: &mut CudaEngine, shape: &[usize]) -> Result<Self> {
        Self::alloc_on(engine, Lane::Compute, shape)
    }

    /// Allocates an uninitialised tensor ordered on `lane`: the lane of the work that writes it
    /// first (an upload's, for a fresh upload destination), which then needs no cross-lane wait.
    #[track_caller]
    pub(crate) fn alloc_on(engine: &mut CudaEngine, lane: Lane, shape: &[usize]) -> Result<Self> {
        let len = shape_len(shape)?;
        let bytes = byte_len::<T>(len, "device tensor")?;
        let ptr = if bytes == 0 {
            0
        } else {
            alloc_device(&engine.shared, lane, bytes, Owner::Tensors)?
        };
        Ok(DeviceTensor {
            ptr,
            len,
            shape: Shape::new(shape),
            owner: Arc::clone(&engine.shared),
            recycle: None,
            home: None,
            _element: PhantomData,
        })
    }

    /// A tensor of `shape` over `ptr`, memory whose drop goes to `home`.
    ///
    /// # Safety
    /// `ptr` is memory `owner`'s driver reaches, of at least `len` elements of `T`, valid `T`s
    /// once the work `owner`'s streams wait for has run, and `home` is what releases it.
    pub(crate) unsafe fn homed(
        ptr: DevicePtr,
        shape: &[usize],
        len: usize,
        owner: &Arc<Shared>,
        home: Arc<dyn Home>,
    ) -> Self {
        DeviceTensor {
            ptr,
            len,
            shape: Shape::new(shape),
            owner: Arc::clone(owner),
            recycle: None,
            home: Some(home),
            _element: PhantomData,
        }
    }

    /// Where the memory goes when the tensor is dropped, if not to the driver.
    pub(crate) fn home(&self) -> Option<&Arc<dyn Home>> {
        self.home.as_ref()
    }

    /// Sends the memory to `home` when the tensor is dropped.
    pub(crate) fn set_home(&mut self, home: Arc<dyn Home>) {
        self.home = Some(home);
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        T::DTYPE
    }

    /// The size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * T::DTYPE.size_bytes()
    }

    /// The device it lives on.
    pub fn device(&self) -> DeviceId {
        self.owner.device
    }

    /// The engine that owns it (see [`CudaEngine::id`]).
    pub fn engine_id(&self) -> u64 {
        self.owner.engine_id
    }

    /// Gives the tensor a new shape with the same element count. No data moves.
    ///
    /// # Errors
    /// [`UsageError::LengthMismatch`](crate::error::UsageError::LengthMismatch) when the element
    /// counts differ, [`UsageError::ShapeOverflow`](crate::error::UsageError::ShapeOverflow) when
    /// the shape's element count overflows `usize`; the tensor comes back unchanged, in
    /// [`SubmitError::Rejected`] (the only outcome: nothing is queued).
    // The refusal hands the tensor back by value, as `TrySendError<T>` does; the error is large
    // by design and travels only on the refusal path.
    #[allow(clippy::result_large_err)]
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self, SubmitError<Self>> {
        let refusal = match shape_len(shape) {
            Ok(expected) if expected == self.len => None,
            Ok(expected) => Some(Error::Usage(UsageError::LengthMismatch {
                what: "reshape: the tensor for the new shape",
                expected,
                found: self.len,
                shape: Some(shape.to_vec()),
            })),
            Err(error) => Some(error),
        };
        if let Some(error) = refusal {
            return Err(SubmitError::Rejected { input: self, error });
        }
        self.shape = Shape::new(shape);
        Ok(self)
    }

    pub(crate) fn owner(&self) -> &Shared {
        &self.owner
    }

    /// The engine's shared core, for a value that outlives this borrow.
    pub(crate) fn owner_arc(&self) -> Arc<Shared> {
        Arc::clone(&self.owner)
    }
}

#[cfg(any(feature = "safetensors", feature = "dlpack"))]
impl<T: Element> DeviceTensor<T> {
    /// Moves this tensor's memory into a tensor of element type `U`, `len` elements of `shape`;
    /// this tensor is left empty (address 0), so its drop frees nothing.
    fn retype<U: Element>(mut self, len: usize, shape: Shape) -> DeviceTensor<U> {
        DeviceTensor {
            ptr: std::mem::replace(&mut self.ptr, 0),
            len,
            shape,
            owner: Arc::clone(&self.owner),
            recycle: self.recycle.take(),
            home: self.home.take(),
            _element: PhantomData,
        }
    }
}

#[cfg(any(feature = "safetensors", feature = "dlpack"))]
impl DeviceTensor<u8> {
    /// The same memory as a tensor of `T` of `shape`, whose elements fill these bytes exactly;
    /// `None` (and the bytes dropped, stream-ordered as ever) when they do not. The bytes are
    /// aligned to the element: an allocation of the driver's, or a part of one at a multiple of
    /// the element's size (a checkpoint's small tensors).
    ///
    /// # Safety
    /// Once the work queued on the memory so far has run, every `size_of::<T>()` bytes of it are
    /// a valid `T`: any bit pattern for the numeric types, 0 or 1 for `bool`.
    pub(crate) unsafe fn reinterpret<T: Element>(self, shape: &[usize]) -> Option<DeviceTensor<T>> {
        let len: usize = shape.iter().product();
        if len.checked_mul(T::DTYPE.size_bytes()) != Some(self.len) {
            return None;
        }
        Some(self.retype(len, Shape::new(shape)))
    }
}

impl<T: Element> DeviceTensor<T> {
    /// A tensor of `shape` (`len` elements) over memory the caller allocated on `owner`'s
    /// driver: for code that allocates several tensors under one lock. When dropped, the memory
    /// goes to `recycle` if it has room, else back to the driver.
    ///
    /// # Safety
    /// `ptr` came from `owner`'s [`Driver::alloc`](crate::driver::Driver::alloc) with exactly
    /// `len` elements of `T` (or is 0 when `len` is 0), and nothing else owns or frees it.
    pub(crate) unsafe fn from_raw(
        ptr: DevicePtr,
        shape: &[usize],
        len: usize,
        owner: &Arc<Shared>,
        recycle: Option<&Arc<Recycler>>,
    ) -> Self {
        DeviceTensor {
            ptr,
            len,
            shape: Shape::new(shape),
            owner: Arc::clone(owner),
            recycle: recycle.cloned(),
            home: None,
            _element: PhantomData,
        }
    }

    /// Gives up the tensor's memory without freeing it, for memory another engine's stream may
    /// still write and that nothing can order this engine's free after: the tensor becomes an
    /// empty tensor of the same engine, and the memory is leaked.
    pub(crate) fn leak_memory(&mut self) {
        self.ptr = 0;
        self.len = 0;
        self.shape = Shape::new(&[0]);
        self.recycle = None;
        // Leaked memory goes nowhere: an exporter keeps memory whose import is leaked.
        self.home = None;
    }

    /// Takes the tensor's memory out of it, for as long as another library's stream may use it:
    /// the tensor becomes an empty tensor of the same engine (as [`leak_memory`](Self::leak_memory)
    /// leaves it), so its drop frees nothing, and the memory comes back only through
    /// [`restore_memory`](Self::restore_memory). A [`Taken`] that is forgotten leaks the memory.
    pub(crate) fn take_memory(&mut self) -> Taken {
        Taken {
            ptr: std::mem::replace(&mut self.ptr, 0),
            len: std::mem::replace(&mut self.len, 0),
            shape: std::mem::replace(&mut self.shape, Shape::new(&[0])),
            recycle: self.recycle.take(),
            home: self.home.take(),
        }
    }

    /// Puts back the memory [`take_memory`](Self::take_memory) took out of this tensor; the
    /// memory this (empty) tensor holds meanwhile, none, is dropped.
    pub(crate) fn restore_memory(&mut self, mut taken: Taken) {
        debug_assert_eq!(self.ptr, 0, "memory restored into a tensor that holds some");
        self.ptr = std::mem::replace(&mut taken.ptr, 0);
        self.len = taken.len;
        self.shape = std::mem::take(&mut taken.shape);
        self.recycle = taken.recycle.take();
        self.home = taken.home.take();
    }

    pub(crate) fn raw_ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The tensor's device address on a simulated device (feature `sim`), for reading what the
    /// device holds there with [`SimDevice::peek`](crate::sim::SimDevice::peek). Unlike a raw
    /// scope's pointer, it lends nothing, so it queues and orders nothing.
    #[cfg(any(test, feature = "sim"))]
    pub fn sim_address(&self) -> u64 {
        self.ptr
    }

    /// Checks that the tensor belongs to `engine`.
    pub(crate) fn check_engine(&self, engine: &CudaEngine) -> Result<()> {
        engine
            .shared
            .check_owner(self.owner.device, self.owner.engine_id)
    }
}

/// The tensor's bytes when its drop frees them: none when its memory goes elsewhere (a home's,
/// another library's).
impl<T: Element> Held for DeviceTensor<T> {
    fn held_bytes(&self) -> u64 {
        if self.home.is_some() {
            0
        } else {
            self.byte_len() as u64
        }
    }
}

impl<T: Element> Drop for DeviceTensor<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if let Some(home) = self.home.take() {
            home.drop_memory(&self.owner, self.ptr);
            return;
        }
        if let Some(recycle) = &self.recycle
            && recycle.put(self.len * T::DTYPE.size_bytes(), self.ptr)
        {
            return;
        }
        // Leaked (never freed) when the context cannot be entered; see `enter_for_drop`.
        if let Some(mut st) = self.owner.enter_for_drop() {
            let charge = Charge::new(Owner::Tensors, self.byte_len());
            // SAFETY: `ptr` is this tensor's own allocation, freed exactly once here; nothing
            // queued later names it (the tensor is gone).
            unsafe { st.free_device(&*self.owner.waits, self.ptr, charge) };
        }
    }
}

impl CudaEngine {
    /// Allocates a tensor of the given shape whose contents are unspecified until written.
    ///
    /// The allocation is ordered on the engine's upload stream, where a tensor the caller
    /// allocates is most often first written (a pending upload into it queues no cross-stream
    /// wait); a kernel or library call that writes it first waits for the allocation once.
    ///
    /// # Errors
    /// [`UsageError::ShapeOverflow`](crate::error::UsageError::ShapeOverflow) when the shape's element count overflows `usize`,
    /// [`UsageError::SizeOverflow`](crate::error::UsageError::SizeOverflow) when its bytes exceed `isize::MAX` (the most one allocation can
    /// address), [`Error::Driver`] when the allocation fails (out of memory: only after the
    /// memory of retired work the device has finished was released and the allocation tried once
    /// more).
    #[track_caller]
    pub fn alloc_tensor<T: Element>(&mut self, shape: &[usize]) -> Result<DeviceTensor<T>> {
        DeviceTensor::alloc_on(self, Lane::Upload, shape)
    }

    /// Queues a device-to-device copy of `source` into a new tensor of the same shape.
    ///
    /// # Errors
    /// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when `source` is not this engine's;
    /// [`Error::Driver`] when allocation or the copy enqueue fails.
    pub fn copy_tensor<T: Element>(&mut self, source: &DeviceTensor<T>) -> Result<DeviceTensor<T>> {
        source.check_engine(self)?;
        let mut out = DeviceTensor::alloc(self, source.shape())?;
        self.copy_into(source, &mut out)?;
        Ok(out)
    }

    /// Queues a device-to-device copy of `source` into `destination`.
    ///
    /// # Errors
    /// [`UsageError::LengthMismatch`](crate::error::UsageError::LengthMismatch) when the element counts differ; [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when either is not this engine's; [`Error::Driver`] when the
    /// enqueue fails.
    pub fn copy_into<T: Element>(
        &mut self,
        source: &DeviceTensor<T>,
        destination: &mut DeviceTensor<T>,
    ) -> Result<()> {
        source.check_engine(self)?;
        destination.check_engine(self)?;
        if source.len() != destination.len() {
            return Err(Error::Usage(UsageError::LengthMismatch {
                what: "device-to-device copy: source for the destination",
                found: source.len(),
                shape: None,
                expected: destination.len(),
            }));
        }
        if source.is_empty() {
            return Ok(());
        }
        let (dst, src, bytes) = (destination.ptr, source.ptr, source.byte_len());
        let uses = [Use::Read(src), Use::Write(dst)];
        self.enter()?.queue(Lane::Compute, &uses, |driver| {
            // SAFETY: both are live allocations of this engine of `bytes` bytes, distinct (one is
            // borrowed shared, the other exclusively); their frees are queued after this copy,
            // and `queue` orders it after their uses on the copy lanes.
            unsafe { driver.copy_dtod(dst, src, bytes) }.map_err(Error::driver("cuMemcpyDtoDAsync"))
        })
    }
}
