//! DLPack, both ways: exports read by another engine and by an independent implementation
//! (`dlpark`), and every field of a hostile capsule refused with a typed error while its
//! producer's deleter still runs exactly once.

use super::Device;
use cuferry::dlpack::{self, Capsule, Ready, Stream, Strides, Version, ffi};
use cuferry::error::{Error, MalformedError, UsageError};
use cuferry::{CudaEngine, DeviceTensor, SubmitError, download_tensor, upload_tensor};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The engine's compute stream, as a consumer's stream.
fn stream_of(engine: &CudaEngine) -> Stream {
    // SAFETY: the engine's own compute stream, live as long as the engine, which every test
    // keeps until the capsules named with it are gone.
    unsafe { Stream::from_raw(dlpack::engine_stream(engine)) }
}

/// The device address of `tensor`, as a producer outside the crate would hold it.
fn address_of<T: cuferry::Element>(engine: &mut CudaEngine, tensor: &DeviceTensor<T>) -> u64 {
    engine
        .with_raw(|raw| raw.device_ptr(tensor).map(|p| p.as_raw()))
        .unwrap()
}

/// Counts its drops: the context of a `dlpark` capsule, dropped by its deleter.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// What a hostile producer says: each field, as it lands in the capsule.
#[derive(Clone, Debug)]
pub(crate) struct Claim {
    pub(crate) data: u64,
    pub(crate) byte_offset: u64,
    pub(crate) device: (u32, i32),
    pub(crate) dtype: (u8, u8, u16),
    pub(crate) ndim: i32,
    pub(crate) shape: Vec<i64>,
    pub(crate) strides: Option<Vec<i64>>,
    pub(crate) version: (u32, u32),
    pub(crate) flags: u64,
}

impl Claim {
    /// A compact f32 tensor of `shape` at `data` on CUDA device 0.
    pub(crate) fn f32(data: u64, shape: &[i64]) -> Claim {
        Claim {
            data,
            byte_offset: 0,
            device: (ffi::DL_CUDA, 0),
            dtype: (ffi::DL_FLOAT, 32, 1),
            ndim: shape.len() as i32,
            shape: shape.to_vec(),
            strides: None,
            version: (1, 0),
            flags: 0,
        }
    }

    /// The capsule an independent producer (`dlpark`) makes of this claim, and the count of
    /// its deleter's calls; `Err` when the capsule is refused as it is taken (its version).
    pub(crate) fn capsule(&self) -> (Result<Capsule, Error>, Arc<AtomicUsize>) {
        use dlpark::allocation::dynamic::Allocation;
        let count = Arc::new(AtomicUsize::new(0));
        let n = self.shape.len();
        let mut allocation =
            Allocation::<dlpark::ffi::DLManagedTensorVersioned>::allocate(2 * n).unwrap();
        allocation.extra_mut()[..n].copy_from_slice(&self.shape);
        if let Some(strides) = &self.strides {
            allocation.extra_mut()[n..].copy_from_slice(strides);
        }
        let mut init = allocation
            .initialize(Box::new(Counted(Arc::clone(&count))), n)
            .unwrap();
        let extra = init.extra_mut().as_mut_ptr();
        let t = init.tensor_mut();
        t.data = self.data as *mut std::ffi::c_void;
        t.byte_offset = self.byte_offset;
        t.device = dlpark::ffi::DLDevice {
            device_type: dlpark::ffi::DLDeviceType(self.device.0),
            device_id: self.device.1,
        };
        t.dtype = dlpark::ffi::DLDataType {
            code: dlpark::ffi::DLDataTypeCode(self.dtype.0),
            bits: self.dtype.1,
            lanes: self.dtype.2,
        };
        t.ndim = self.ndim;
        t.shape = if n == 0 && self.ndim != 0 {
            std::ptr::null_mut()
        } else {
            extra
        };
        t.strides = match &self.strides {
            // SAFETY: `extra` holds `2 * n` values.
            Some(_) => unsafe { extra.add(n) },
            None => std::ptr::null_mut(),
        };
        // SAFETY: the descriptor is what the test means it to be; it is only read by the crate.
        let managed = unsafe { init.finish() };
        let raw = managed.into_raw();
        // SAFETY: a live managed tensor; the version is set in place.
        unsafe {
            (*raw).version = dlpark::ffi::DLPackVersion {
                major: self.version.0,
                minor: self.version.1,
            };
            (*raw).flags = dlpark::DlpackFlags::from_bits_retain(self.flags as _);
        }
        // SAFETY: `dlpark`'s managed tensor has DLPack's layout, as this crate's `ffi` does, and
        // its deleter may run on any thread.
        let capsule = unsafe { Capsule::from_versioned(raw.cast()) };
        (capsule, count)
    }
}

/// An upload in flight on `a`, exported to `b`'s stream, imported by `b`, read by a kernel of
/// `b` and downloaded: the bytes `a` uploaded, in both ABIs, with no host wait between.
pub(crate) fn an_export_is_read_by_another_engine_after_its_upload(dev: Device) {
    let mut engines = dev.engines(2);
    let mut b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let data: Vec<f32> = (0..(4 << 20)).map(|i| i as f32).collect();
    for version in [Version::V1, Version::Legacy] {
        let x = upload_tensor(&mut a, &data, &[4 << 20]).unwrap();
        let doubled = a.add(&x, &x).unwrap();
        let capsule = dlpack::export(&mut a, doubled, Some(stream_of(&b)), version).unwrap();
        assert_eq!(capsule.is_versioned(), version == Version::V1);
        let y =
            dlpack::import::<f32>(&mut b, capsule, Ready::OnEngineStream, Strides::Refuse).unwrap();
        let z = b.add(&y, &y).unwrap();
        let back = download_tensor(&mut b, &z).unwrap();
        assert!(back.iter().enumerate().all(|(i, &v)| v == 4.0 * i as f32));
        drop((y, z));
        b.synchronize().unwrap();
        a.synchronize().unwrap();
        Device::no_violations(&a);
    }
}

/// A read-only export: flagged so in the capsule, refused by a writable import, read by a
/// read-only one, refused in the legacy ABI (which cannot say so) with the tensor handed back.
pub(crate) fn a_shared_export_is_read_only_on_both_sides(dev: Device) {
    let mut engines = dev.engines(2);
    let mut b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let x = Arc::new(upload_tensor(&mut a, &[1.0f32, 2.0, 3.0], &[3]).unwrap());
    let refused = dlpack::export_shared(&mut a, Arc::clone(&x), None, Version::Legacy).unwrap_err();
    assert!(matches!(
        refused.error(),
        Error::Usage(UsageError::ReadOnly { .. })
    ));
    assert!(refused.into_input().is_some());
    let capsule =
        dlpack::export_shared(&mut a, Arc::clone(&x), Some(stream_of(&b)), Version::V1).unwrap();
    assert!(capsule.is_read_only());
    let Err(SubmitError::Rejected { input, error }) =
        dlpack::import::<f32>(&mut b, capsule, Ready::OnEngineStream, Strides::Refuse)
    else {
        panic!("a read-only capsule was imported writable");
    };
    assert!(
        matches!(error, Error::Usage(UsageError::ReadOnly { .. })),
        "{error}"
    );
    let y = dlpack::import_read_only::<f32>(&mut b, input, Ready::OnEngineStream, Strides::Refuse)
        .unwrap();
    assert_eq!(download_tensor(&mut b, &y).unwrap(), [1.0, 2.0, 3.0]);
    // The engine still reads its own tensor meanwhile.
    assert_eq!(download_tensor(&mut a, &x).unwrap(), [1.0, 2.0, 3.0]);
    drop(y);
    b.synchronize().unwrap();
    assert_eq!(Arc::strong_count(&x), 1, "the capsule let go of its share");
}

/// An independent implementation (`dlpark`) reads what an export describes: device, element
/// type, shape, compact strides, no offset; its drop runs the crate's deleter, which frees the
/// memory after the consumer's stream.
pub(crate) fn dlpark_reads_what_an_export_describes(dev: Device) {
    let mut engines = dev.engines(2);
    let b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let x = upload_tensor(&mut a, &[half::bf16::from_f32(1.5); 24], &[2, 3, 4]).unwrap();
    let address = address_of(&mut a, &x);
    let capsule = dlpack::export(&mut a, x, Some(stream_of(&b)), Version::V1).unwrap();
    let dlpack::RawCapsule::Versioned(raw) = capsule.into_raw() else {
        panic!("a V1 export is versioned");
    };
    // SAFETY: the crate's managed tensor has DLPack's layout, which `dlpark`'s has too.
    let managed = unsafe { dlpark::versioned::Dlpack::from_raw(raw.cast()) }.unwrap();
    assert_eq!((managed.version().major, managed.version().minor), (1, 0));
    let tensor = managed.validate().unwrap();
    assert_eq!(tensor.shape(), [2, 3, 4]);
    assert_eq!(tensor.strides().unwrap(), [12, 4, 1]);
    assert_eq!(tensor.byte_offset(), 0);
    assert_eq!(tensor.data_ptr() as u64, address);
    assert_eq!(tensor.device().device_type.0, ffi::DL_CUDA);
    assert_eq!(
        (
            tensor.dtype().code.0,
            tensor.dtype().bits,
            tensor.dtype().lanes
        ),
        (4, 16, 1)
    );
    drop(managed);
    a.synchronize().unwrap();
    Device::no_violations(&a);
}

/// A transposed view: refused with `Strides::Refuse` (the capsule handed back, its deleter not
/// yet run), copied compact with `Strides::Copy` (the deleter run once the copy is proven).
pub(crate) fn a_strided_capsule_is_refused_or_copied(dev: Device) {
    let mut engines = dev.engines(2);
    let mut b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let (rows, cols) = (3usize, 5usize);
    let data: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
    let x = upload_tensor(&mut a, &data, &[rows, cols]).unwrap();
    a.synchronize().unwrap();
    let address = address_of(&mut a, &x);
    let mut claim = Claim::f32(address, &[cols as i64, rows as i64]);
    claim.strides = Some(vec![1, cols as i64]);
    let (capsule, deleted) = claim.capsule();
    let Err(SubmitError::Rejected { input, error }) =
        dlpack::import::<f32>(&mut b, capsule.unwrap(), Ready::Complete, Strides::Refuse)
    else {
        panic!("a transposed view was imported as compact");
    };
    assert!(
        matches!(error, Error::Usage(UsageError::NotCompact { .. })),
        "{error}"
    );
    assert_eq!(deleted.load(Ordering::SeqCst), 0);
    let t = dlpack::import::<f32>(&mut b, input, Ready::Complete, Strides::Copy).unwrap();
    assert_eq!(t.shape(), [cols, rows]);
    let expected: Vec<f32> = (0..cols)
        .flat_map(|c| (0..rows).map(move |r| (r * cols + c) as f32))
        .collect();
    assert_eq!(download_tensor(&mut b, &t).unwrap(), expected);
    b.synchronize().unwrap();
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    drop(x);
}

/// Every field a producer can get wrong is a typed error naming it, and the producer's deleter
/// runs exactly once (when the handed-back capsule is dropped, or at once for a version this
/// crate cannot read).
pub(crate) fn every_malformed_capsule_field_is_a_typed_error(dev: Device) {
    let mut engines = dev.engines(2);
    let mut b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let x = upload_tensor(&mut a, &[0.0f32; 64], &[64]).unwrap();
    a.synchronize().unwrap();
    let base = address_of(&mut a, &x);
    let good = Claim::f32(base, &[8, 8]);
    let malformed = |field: &str| {
        let field = field.to_string();
        move |e: &Error| matches!(e, Error::Malformed(MalformedError::Capsule { field: f, .. }) if *f == field)
    };
    let foreign = |e: &Error| matches!(e, Error::Usage(UsageError::ForeignDevice { .. }));
    type Check = Box<dyn Fn(&Error) -> bool>;
    let cases: Vec<(&str, Claim, Check)> = vec![
        (
            "null data",
            Claim {
                data: 0,
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.data")),
        ),
        (
            "negative extent",
            Claim {
                shape: vec![8, -8],
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.shape")),
        ),
        (
            "overflowing shape",
            Claim {
                shape: vec![i64::MAX, 4],
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.shape")),
        ),
        (
            "65 dimensions",
            Claim {
                ndim: 65,
                shape: vec![1; 65],
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.ndim")),
        ),
        (
            "negative rank",
            Claim {
                ndim: -1,
                shape: vec![],
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.ndim")),
        ),
        (
            "null shape",
            Claim {
                ndim: 2,
                shape: vec![],
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.shape")),
        ),
        (
            "complex element",
            Claim {
                dtype: (5, 64, 1),
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.dtype")),
        ),
        (
            "vector lanes",
            Claim {
                dtype: (ffi::DL_FLOAT, 32, 4),
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.dtype")),
        ),
        (
            "misaligned offset",
            Claim {
                byte_offset: 2,
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.byte_offset")),
        ),
        (
            "past the allocation",
            Claim {
                shape: vec![8, 9],
                ..good.clone()
            },
            Box::new(malformed("dl_tensor")),
        ),
        (
            "offset past the allocation",
            Claim {
                byte_offset: 4,
                ..good.clone()
            },
            Box::new(malformed("dl_tensor")),
        ),
        (
            "before the allocation",
            Claim {
                strides: Some(vec![-8, 1]),
                ..good.clone()
            },
            Box::new(malformed("dl_tensor")),
        ),
        (
            "no allocation",
            Claim {
                data: 0x1000,
                ..good.clone()
            },
            Box::new(malformed("dl_tensor.data")),
        ),
        (
            "another device",
            Claim {
                device: (ffi::DL_CUDA, 7),
                ..good.clone()
            },
            Box::new(foreign),
        ),
        (
            "host memory",
            Claim {
                device: (ffi::DL_CPU, 0),
                ..good.clone()
            },
            Box::new(foreign),
        ),
        (
            "pinned host memory",
            Claim {
                device: (ffi::DL_CUDA_HOST, 0),
                ..good.clone()
            },
            Box::new(foreign),
        ),
    ];
    for (what, claim, check) in cases {
        let (capsule, deleted) = claim.capsule();
        let refused = dlpack::import_any(&mut b, capsule.unwrap(), Ready::Complete, Strides::Copy)
            .expect_err(what);
        let SubmitError::Rejected { input, error } = refused else {
            panic!("{what}: refused without the capsule back");
        };
        assert!(check(&error), "{what}: {error}");
        assert_eq!(deleted.load(Ordering::SeqCst), 0, "{what}");
        drop(input);
        assert_eq!(
            deleted.load(Ordering::SeqCst),
            1,
            "{what}: the deleter once"
        );
    }
    // A major version this crate cannot read: refused as it is taken, the deleter run once.
    let (capsule, deleted) = Claim {
        version: (2, 0),
        ..good.clone()
    }
    .capsule();
    let error = capsule.unwrap_err();
    assert!(malformed("version")(&error), "{error}");
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    // A null managed tensor.
    // SAFETY: null is refused before anything is read.
    let null = unsafe { Capsule::from_versioned(std::ptr::null_mut()) }.unwrap_err();
    assert!(malformed("managed tensor")(&null), "{null}");
    // Another element type than the one asked for.
    let (capsule, deleted) = good.capsule();
    let refused = dlpack::import::<u32>(&mut b, capsule.unwrap(), Ready::Complete, Strides::Refuse)
        .unwrap_err();
    assert!(matches!(
        refused.error(),
        Error::Usage(UsageError::ElementTypeMismatch { .. })
    ));
    drop(refused);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    b.synchronize().unwrap();
    drop(x);
}

/// An import is released (its producer's deleter run) only once the engine's last use of it is
/// proven complete, and two writable imports of the same bytes are refused.
pub(crate) fn an_import_is_released_after_the_engines_last_use(dev: Device) {
    let mut engines = dev.engines(2);
    let mut b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let x = upload_tensor(&mut a, &[2.0f32; 1 << 20], &[1 << 20]).unwrap();
    a.synchronize().unwrap();
    let base = address_of(&mut a, &x);
    let (capsule, deleted) = Claim::f32(base, &[1 << 20]).capsule();
    let y =
        dlpack::import::<f32>(&mut b, capsule.unwrap(), Ready::Complete, Strides::Refuse).unwrap();
    // A second writable view of the same bytes is refused; read-only views are not.
    let (second, second_deleted) = Claim::f32(base + 4096, &[16]).capsule();
    let refused = dlpack::import::<f32>(&mut b, second.unwrap(), Ready::Complete, Strides::Refuse)
        .unwrap_err();
    assert!(
        matches!(refused.error(), Error::Usage(UsageError::Overlaps { .. })),
        "{}",
        refused.error()
    );
    drop(refused);
    assert_eq!(second_deleted.load(Ordering::SeqCst), 1);
    let z = b.add(&y, &y).unwrap();
    drop(y);
    assert_eq!(
        deleted.load(Ordering::SeqCst),
        0,
        "released before the engine's use was proven"
    );
    b.synchronize().unwrap();
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    assert!(
        download_tensor(&mut b, &z)
            .unwrap()
            .iter()
            .all(|&v| v == 4.0)
    );
    // Once released, the bytes may be imported writable again.
    let (again, again_deleted) = Claim::f32(base, &[16]).capsule();
    let w =
        dlpack::import::<f32>(&mut b, again.unwrap(), Ready::Complete, Strides::Refuse).unwrap();
    drop(w);
    b.synchronize().unwrap();
    assert_eq!(again_deleted.load(Ordering::SeqCst), 1);
    drop(x);
}

/// A `bool` capsule is copied through a cast, so every byte the engine holds is 0 or 1; a
/// capsule of no elements is imported without memory, its deleter run at once.
pub(crate) fn bool_and_empty_capsules_are_imported_safely(dev: Device) {
    let mut engines = dev.engines(2);
    let mut b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let x = upload_tensor(&mut a, &[0u8, 1, 2, 255], &[4]).unwrap();
    a.synchronize().unwrap();
    let base = address_of(&mut a, &x);
    let claim = Claim {
        dtype: (ffi::DL_BOOL, 8, 1),
        ..Claim::f32(base, &[4])
    };
    let (capsule, deleted) = claim.capsule();
    let t =
        dlpack::import::<bool>(&mut b, capsule.unwrap(), Ready::Complete, Strides::Refuse).unwrap();
    assert_eq!(
        download_tensor(&mut b, &t).unwrap(),
        [false, true, true, true]
    );
    b.synchronize().unwrap();
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    let (capsule, deleted) = Claim {
        data: 0,
        ..Claim::f32(0, &[0, 3])
    }
    .capsule();
    let empty =
        dlpack::import::<f32>(&mut b, capsule.unwrap(), Ready::Complete, Strides::Refuse).unwrap();
    assert_eq!((empty.shape(), empty.len()), (&[0, 3][..], 0));
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    drop(x);
}

/// The capsule's deleter, run on another thread after the exporting engine is gone, frees the
/// memory after the consumer's stream; nothing leaks, nothing races.
pub(crate) fn the_deleter_runs_on_another_thread_after_the_engine_is_gone(dev: Device) {
    let mut engines = dev.engines(2);
    let mut b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let x = upload_tensor(&mut a, &[7i32; 1 << 16], &[1 << 16]).unwrap();
    let capsule = dlpack::export(&mut a, x, Some(stream_of(&b)), Version::V1).unwrap();
    let y = dlpack::import::<i32>(&mut b, capsule, Ready::OnEngineStream, Strides::Refuse).unwrap();
    let z = b.add(&y, &y).unwrap();
    drop(a);
    std::thread::spawn(move || drop(y)).join().unwrap();
    b.synchronize().unwrap();
    assert!(
        download_tensor(&mut b, &z)
            .unwrap()
            .iter()
            .all(|&v| v == 14)
    );
    Device::no_violations(&b);
}

/// A tensor that goes out and comes back twice (export, import, export, import): the first
/// import, inside the second capsule, no longer counts as a live view of the engine, so the
/// second import of the same bytes is admitted; a live view still refuses a second writable one.
pub(crate) fn a_tensor_goes_out_and_back_twice(dev: Device) {
    let mut engines = dev.engines(2);
    let mut b = engines.pop().unwrap();
    let mut a = engines.pop().unwrap();
    let x = upload_tensor(&mut a, &[3u16; 256], &[16, 16]).unwrap();
    let mut tensor = x;
    for round in 0..2 {
        let out = dlpack::export(&mut a, tensor, Some(stream_of(&b)), Version::V1).unwrap();
        let there = dlpack::import::<u16>(&mut b, out, Ready::OnEngineStream, Strides::Refuse)
            .unwrap_or_else(|e| panic!("round {round}, into b: {e}"));
        let back = dlpack::export(&mut b, there, Some(stream_of(&a)), Version::Legacy).unwrap();
        tensor = dlpack::import::<u16>(&mut a, back, Ready::OnEngineStream, Strides::Refuse)
            .unwrap_or_else(|e| panic!("round {round}, back into a: {e}"));
    }
    assert_eq!(download_tensor(&mut a, &tensor).unwrap(), [3u16; 256]);
    drop(tensor);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    a.synchronize().unwrap();
    Device::no_violations(&a);
}

/// The bodies of this module, for `tests/sim/dlpack.rs` and `tests/gpu/dlpack.rs`.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; dlpack::{
            an_export_is_read_by_another_engine_after_its_upload,
            a_shared_export_is_read_only_on_both_sides,
            dlpark_reads_what_an_export_describes,
            a_strided_capsule_is_refused_or_copied,
            every_malformed_capsule_field_is_a_typed_error,
            an_import_is_released_after_the_engines_last_use,
            bool_and_empty_capsules_are_imported_safely,
            the_deleter_runs_on_another_thread_after_the_engine_is_gone,
            a_tensor_goes_out_and_back_twice,
        });
    };
}
pub(crate) use tests;
