//! The sharing half of the seam on a real device: the engine's pool exported as a POSIX file
//! descriptor, its allocations as export data, and inter-process events.

use super::CudaDriver;
use crate::driver::share::{Name, Origin, Sharing, start_of};
use crate::driver::{DevicePtr, EventHandle, Lane};
use crate::error::{DriverError, Error};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The UUID of `device`.
pub(super) fn uuid_of(device: sys::CUdevice) -> Result<[u8; 16], DriverError> {
    let mut uuid = MaybeUninit::<sys::CUuuid>::uninit();
    // SAFETY: out pointer valid for one write.
    DriverError::check(unsafe { sys::cuDeviceGetUuid_v2(uuid.as_mut_ptr(), device) })?;
    // SAFETY: written by the successful call above.
    let uuid = unsafe { uuid.assume_init() };
    Ok(uuid.bytes.map(|b| b as u8))
}

impl Sharing for CudaDriver {
    fn process(&self) -> Result<Origin, Error> {
        Origin::here()
    }

    fn process_ended(&self, origin: &Origin) -> bool {
        match Origin::here() {
            Ok(here) if here.host == origin.host && here.boot == origin.boot => {
                start_of(origin.pid) != Some(origin.start)
            }
            // Another host's or boot's process has no context here; and a host whose identity
            // cannot be read cannot tell, so it keeps what it holds.
            Ok(_) => true,
            Err(_) => false,
        }
    }

    fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    fn reaches(&self, uuid: &[u8; 16]) -> Result<bool, DriverError> {
        if *uuid == self.uuid {
            return Ok(true);
        }
        let mut count = 0;
        // SAFETY: out pointer valid.
        DriverError::check(unsafe { sys::cuDeviceGetCount(&mut count) })?;
        for ordinal in 0..count {
            let mut device = MaybeUninit::uninit();
            // SAFETY: out pointer valid; `ordinal` is below the count.
            DriverError::check(unsafe { sys::cuDeviceGet(device.as_mut_ptr(), ordinal) })?;
            // SAFETY: written by the successful call above.
            let device = unsafe { device.assume_init() };
            if uuid_of(device)? == *uuid {
                let mut can = 0;
                // SAFETY: out pointer valid; both devices exist.
                DriverError::check(unsafe {
                    sys::cuDeviceCanAccessPeer(&mut can, self.device, device)
                })?;
                return Ok(can != 0);
            }
        }
        Ok(false)
    }

    fn pool_descriptor(&mut self) -> Result<RawFd, DriverError> {
        if !self.exportable {
            return Err(DriverError::from_raw(
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
            ));
        }
        if let Some(fd) = &self.pool_fd {
            return Ok(fd.as_raw_fd());
        }
        let mut fd: RawFd = -1;
        // SAFETY: the pool is this driver's, made exportable as POSIX descriptors; the handle
        // out pointer is an `int`, as that handle type writes.
        DriverError::check(unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&mut fd as *mut RawFd).cast::<c_void>(),
                self.pool,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the export just made `fd`, for this driver alone.
        self.pool_fd = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(fd)
    }

    fn export_pointer(&mut self, ptr: DevicePtr) -> Result<Name, DriverError> {
        let mut data = MaybeUninit::<sys::CUmemPoolPtrExportData>::uninit();
        // SAFETY: out pointer valid; the driver checks that `ptr` is an allocation of an
        // exported pool (and refuses it otherwise).
        DriverError::check(unsafe { sys::cuMemPoolExportPointer(data.as_mut_ptr(), ptr) })?;
        // SAFETY: written by the successful call above.
        Ok(unsafe { data.assume_init() }.reserved)
    }

    fn import_pool(&mut self, fd: RawFd, from: &[u8; 16]) -> Result<u64, DriverError> {
        let mut pool = MaybeUninit::uninit();
        // SAFETY: out pointer valid; a POSIX descriptor handle is the descriptor's value cast
        // to a pointer, as CUDA documents; the driver checks what the descriptor names.
        DriverError::check(unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                pool.as_mut_ptr(),
                fd as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: written by the successful call above.
        let pool = unsafe { pool.assume_init() };
        self.imported_pools.push(pool);
        if *from != self.uuid {
            // Another device's pool: this device reaches its blocks only once the pool says so.
            // SAFETY: an all-zero descriptor is a valid start; every field is set below.
            let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = self.device;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            // SAFETY: the pool was imported just above; one descriptor, valid for the call.
            DriverError::check(unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) })?;
        }
        Ok(pool as u64)
    }

    unsafe fn import_pointer(&mut self, pool: u64, data: &Name) -> Result<DevicePtr, DriverError> {
        let mut data = sys::CUmemPoolPtrExportData { reserved: *data };
        let mut ptr = MaybeUninit::uninit();
        // SAFETY: `pool` is one this driver imported (the route passes only those); out pointer
        // valid; the driver checks the export data against the pool.
        DriverError::check(unsafe {
            sys::cuMemPoolImportPointer(ptr.as_mut_ptr(), pool as sys::CUmemoryPool, &mut data)
        })?;
        // SAFETY: written by the successful call above.
        Ok(unsafe { ptr.assume_init() })
    }

    unsafe fn release_import(&mut self, lane: Lane, ptr: DevicePtr) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees `ptr` is a live import of this driver, ordered before
        // this release on `lane` with every use of it; freeing an imported pointer unmaps it.
        DriverError::check(unsafe { sys::cuMemFreeAsync(ptr, self.lane(lane)) })
    }

    fn address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize), DriverError> {
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: both out pointers are valid for one write; the driver checks `ptr` against
        // the current context's mappings (the route calls this inside the engine's context) and
        // refuses an address it does not map.
        DriverError::check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) })?;
        Ok((base, size))
    }

    fn ipc_event_create(&mut self) -> Result<(EventHandle, Name), DriverError> {
        let mut ev = MaybeUninit::uninit();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        // SAFETY: out pointer valid; an inter-process event must have timing disabled, as here.
        DriverError::check(unsafe { sys::cuEventCreate(ev.as_mut_ptr(), flags) })?;
        // SAFETY: written by the successful call above.
        let ev = unsafe { ev.assume_init() };
        let mut handle = MaybeUninit::<sys::CUipcEventHandle>::uninit();
        // SAFETY: out pointer valid; `ev` is an inter-process event of this context.
        let got = DriverError::check(unsafe { sys::cuIpcGetEventHandle(handle.as_mut_ptr(), ev) });
        if let Err(error) = got {
            // SAFETY: the event was created above and never recorded.
            unsafe { sys::cuEventDestroy_v2(ev) };
            return Err(error);
        }
        // SAFETY: written by the successful call above.
        let handle = unsafe { handle.assume_init() };
        Ok((EventHandle(ev as u64), handle.reserved.map(|b| b as u8)))
    }

    fn ipc_event_open(&mut self, handle: &Name) -> Result<EventHandle, DriverError> {
        let handle = sys::CUipcEventHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ev = MaybeUninit::uninit();
        // SAFETY: out pointer valid; the driver checks the handle.
        DriverError::check(unsafe { sys::cuIpcOpenEventHandle(ev.as_mut_ptr(), handle) })?;
        // SAFETY: written by the successful call above.
        Ok(EventHandle(unsafe { ev.assume_init() } as u64))
    }

    unsafe fn ipc_event_close(&mut self, event: EventHandle) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the event was opened here and is not used again;
        // destroying an opened event closes this process's handle to it.
        DriverError::check(unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) })
    }
}
