//! The kernel half of the seam on a real device: NVRTC compiles, the driver loads and launches.
//!
//! NVRTC is loaded at run time like the driver. cudarc panics when a dynamically loaded library
//! is missing, so [`nvrtc_present`] probes for it (once per process) before the first call, and
//! an absent NVRTC is a typed [`SetupError::Unavailable`](crate::error::SetupError::Unavailable).

use super::CudaDriver;
use crate::driver::launch::{FunctionHandle, Launch, ModuleHandle, ModuleSource};
use crate::error::{DriverError, Error, LibraryError, SetupError};
use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc;
use std::ffi::{CString, c_char, c_int, c_void};
use std::mem::MaybeUninit;
use std::sync::OnceLock;

/// Launches (and kernel node updates) with up to this many parameters build their pointer array
/// on the stack.
const INLINE_PARAMS: usize = 8;

/// Whether NVRTC can be loaded on this machine (probed once).
pub(crate) fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only attempts to `dlopen` candidate library names.
    *PRESENT.get_or_init(|| unsafe { nvrtc::is_culib_present() })
}

/// Compiles CUDA C++ `cuda` (program `name`) to PTX for compute capability 9.0, as a module
/// load would, without a device: for the tests that check every kernel the crate writes
/// compiles.
///
/// # Errors
/// As [`Launch::module_compile`]'s compile step: NVRTC missing, or its log.
#[cfg(test)]
pub(crate) fn compile_check(name: &str, cuda: &str) -> Result<(), Error> {
    let source = ModuleSource {
        name,
        cuda,
        #[cfg(any(test, feature = "sim"))]
        emulation: None,
    };
    compile_ptx(&source, 90).map(drop)
}

fn nvrtc_status_name(status: nvrtc::nvrtcResult) -> String {
    format!("{status:?}")
}

/// A compiled program, destroyed on drop.
struct Program(nvrtc::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `nvrtcCreateProgram` and is destroyed once, here.
        unsafe {
            nvrtc::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) unless NVRTC can be loaded. Every NVRTC call is preceded by this,
/// because cudarc panics when the library is missing.
fn require_nvrtc() -> Result<(), Error> {
    if nvrtc_present() {
        return Ok(());
    }
    Err(Error::Setup(SetupError::Unavailable {
        library: "NVRTC",
        detail: format!(
            "none of {:?} could be loaded",
            cudarc::get_lib_name_candidates("nvrtc")
        ),
    }))
}

/// The newest architecture in `supported` the device (`device_arch`, e.g. 90) can run; 0 (let
/// NVRTC choose its default) when none is.
fn choose_arch(device_arch: i32, supported: &[c_int]) -> i32 {
    supported
        .iter()
        .copied()
        .filter(|&a| a <= device_arch)
        .max()
        .unwrap_or(0)
}

/// The virtual architectures this NVRTC can target. Empty when it cannot say. Call only after
/// [`require_nvrtc`].
fn nvrtc_archs() -> Vec<c_int> {
    let mut count: c_int = 0;
    // SAFETY: NVRTC is present (checked by the caller); the out pointer is valid.
    let status = unsafe { nvrtc::nvrtcGetNumSupportedArchs(&mut count) };
    if status != nvrtc::nvrtcResult::NVRTC_SUCCESS || count <= 0 {
        return Vec::new();
    }
    let mut archs = vec![0 as c_int; usize::try_from(count).unwrap_or(0)];
    // SAFETY: `archs` holds the `count` entries NVRTC reported it will write.
    let status = unsafe { nvrtc::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
    if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Vec::new();
    }
    archs
}

/// Compiles CUDA C++ to PTX (NUL-terminated) for virtual architecture `arch` (0: NVRTC's
/// default).
fn compile_ptx(source: &ModuleSource<'_>, arch: i32) -> Result<Vec<c_char>, Error> {
    require_nvrtc()?;
    let compile_error = |status: nvrtc::nvrtcResult, log: String| {
        Error::Library(LibraryError::Compile {
            kernel: source.name.to_owned(),
            status: nvrtc_status_name(status),
            log,
        })
    };
    let invalid = |what: &str| {
        compile_error(
            nvrtc::nvrtcResult::NVRTC_ERROR_INVALID_INPUT,
            format!("{what} contains a NUL byte"),
        )
    };
    let text = CString::new(source.cuda).map_err(|_| invalid("source"))?;
    let name = CString::new(source.name).map_err(|_| invalid("name"))?;
    let mut raw = MaybeUninit::uninit();
    // SAFETY: NVRTC is present; `text` and `name` are NUL-terminated and outlive the program
    // (declared before it, so dropped after it); no headers are passed.
    let status = unsafe {
        nvrtc::nvrtcCreateProgram(
            raw.as_mut_ptr(),
            text.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Err(compile_error(status, String::new()));
    }
    // SAFETY: written by the successful call above.
    let program = Program(unsafe { raw.assume_init() });

    let options: Vec<CString> = if arch > 0 {
        vec![
            CString::new(format!("--gpu-architecture=compute_{arch}"))
                .map_err(|_| invalid("option"))?,
        ]
    } else {
        Vec::new()
    };
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let option_count = c_int::try_from(option_ptrs.len()).unwrap_or(0);
    let options = option_ptrs.as_ptr();
    // SAFETY: `program` is live; the option pointers are NUL-terminated strings that outlive
    // the call.
    let status = unsafe { nvrtc::nvrtcCompileProgram(program.0, option_count, options) };
    if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        // SAFETY: `program` is live and was compiled (unsuccessfully), so it has a log.
        let log = unsafe { cudarc::nvrtc::result::get_program_log(program.0) }
            .map(|chars| c_chars_to_string(&chars))
            .unwrap_or_default();
        return Err(compile_error(status, log));
    }
    // SAFETY: `program` is live and compiled successfully.
    unsafe { cudarc::nvrtc::result::get_ptx(program.0) }
        .map_err(|e| compile_error(e.0, String::new()))
}

impl CudaDriver {
    /// The newest virtual architecture NVRTC supports that the device can run.
    fn target_arch(&self) -> Result<i32, Error> {
        let attr = |a| {
            // SAFETY: `self.device` came from `cuDeviceGet`; the attribute is a plain query.
            unsafe { cudarc::driver::result::device::get_attribute(self.device, a) }.map_err(|e| {
                Error::Driver {
                    call: "cuDeviceGetAttribute",
                    source: DriverError::from_raw(e.0),
                }
            })
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok(choose_arch(major * 10 + minor, &nvrtc_archs()))
    }
}

/// Calls `f` with the `kernelParams` array the driver takes for `params`: one pointer per
/// parameter, to its value (null when there are none). The driver only reads through them, so
/// they point straight into `params`; they are valid during `f` only, which is enough because
/// every call that takes them (`cuLaunchKernel`, `cuGraphExecKernelNodeSetParams`) copies the
/// values before it returns.
pub(super) fn with_kernel_params<R>(params: &[u64], f: impl FnOnce(*mut *mut c_void) -> R) -> R {
    let pointer = |p: &u64| (p as *const u64).cast_mut().cast::<c_void>();
    let mut inline = [std::ptr::null_mut::<c_void>(); INLINE_PARAMS];
    let mut heap = Vec::new();
    let pointers: &mut [*mut c_void] = if params.len() <= INLINE_PARAMS {
        for (slot, p) in inline.iter_mut().zip(params) {
            *slot = pointer(p);
        }
        &mut inline[..params.len()]
    } else {
        heap.extend(params.iter().map(pointer));
        &mut heap
    };
    let kernel_params = if pointers.is_empty() {
        std::ptr::null_mut()
    } else {
        pointers.as_mut_ptr()
    };
    f(kernel_params)
}

impl Launch for CudaDriver {
    fn module_compile(&mut self, source: &ModuleSource<'_>) -> Result<ModuleHandle, Error> {
        // Before `target_arch`, which asks NVRTC for its architectures.
        require_nvrtc()?;
        let ptx = compile_ptx(source, self.target_arch()?)?;
        if ptx.last() != Some(&0) {
            return Err(Error::Library(LibraryError::Compile {
                kernel: source.name.to_owned(),
                status: "PTX is not NUL-terminated".into(),
                log: String::new(),
            }));
        }
        let mut module = MaybeUninit::uninit();
        // SAFETY: the engine made this driver's context current; `ptx` is a NUL-terminated PTX
        // image that lives through the call (the driver copies it).
        DriverError::check(unsafe {
            sys::cuModuleLoadData(module.as_mut_ptr(), ptx.as_ptr().cast::<c_void>())
        })
        .map_err(Error::driver("cuModuleLoadData"))?;
        // SAFETY: written by the successful call above.
        Ok(ModuleHandle(unsafe { module.assume_init() } as u64))
    }

    fn module_function(
        &mut self,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        let name = CString::new(name).map_err(|_| DriverError::INVALID_VALUE)?;
        let mut function = MaybeUninit::uninit();
        // SAFETY: module handles reaching here were minted by `module_compile` and are live until
        // `module_unload`; `name` is NUL-terminated.
        DriverError::check(unsafe {
            sys::cuModuleGetFunction(
                function.as_mut_ptr(),
                module.0 as sys::CUmodule,
                name.as_ptr(),
            )
        })?;
        // SAFETY: written by the successful call above.
        Ok(FunctionHandle(unsafe { function.assume_init() } as u64))
    }

    unsafe fn module_unload(&mut self, module: ModuleHandle) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the module is live, unloaded once, and idle.
        DriverError::check(unsafe { sys::cuModuleUnload(module.0 as sys::CUmodule) })
    }

    unsafe fn launch(
        &mut self,
        function: FunctionHandle,
        grid: u32,
        block: u32,
        params: &[u64],
    ) -> Result<(), DriverError> {
        with_kernel_params(params, |kernel_params| {
            // SAFETY: `function` is a live kernel of this driver whose signature is exactly
            // `params.len()` 8-byte parameters (the caller's contract); `kernel_params` names
            // each of them and lives through the call (the driver copies the values at launch);
            // the caller guarantees the memory the kernel touches stays valid until it completes;
            // the stream belongs to the current context.
            DriverError::check(unsafe {
                sys::cuLaunchKernel(
                    function.0 as sys::CUfunction,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    0,
                    self.lane(crate::driver::Lane::Compute),
                    kernel_params,
                    std::ptr::null_mut(),
                )
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_text_stops_at_nul() {
        let raw: Vec<c_char> = b"error: x\0junk".iter().map(|&b| b as c_char).collect();
        assert_eq!(c_chars_to_string(&raw), "error: x");
    }

    #[test]
    fn the_newest_architecture_the_device_runs_is_chosen() {
        assert_eq!(choose_arch(90, &[75, 80, 86, 89, 90, 100, 120]), 90);
        assert_eq!(choose_arch(87, &[75, 80, 86, 89, 90]), 86);
        assert_eq!(choose_arch(70, &[75, 80]), 0);
        assert_eq!(choose_arch(90, &[]), 0);
    }

    #[test]
    #[ignore = "needs NVRTC (libnvrtc) on the library path"]
    fn nvrtc_compiles_to_nul_terminated_ptx_and_reports_errors_with_the_log() {
        let good = ModuleSource {
            name: "good",
            cuda: "extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }",
            emulation: None,
        };
        let archs = nvrtc_archs();
        assert!(archs.contains(&90), "{archs:?}");
        let ptx = compile_ptx(&good, choose_arch(90, &archs)).unwrap();
        assert_eq!(ptx.last(), Some(&0));
        let text = c_chars_to_string(&ptx);
        assert!(
            text.contains(".entry k") && text.contains(".target sm_90"),
            "{text}"
        );

        let bad = ModuleSource {
            name: "bad",
            cuda: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
            emulation: None,
        };
        match compile_ptx(&bad, 0) {
            Err(Error::Library(LibraryError::Compile {
                kernel,
                status,
                log,
            })) => {
                assert_eq!(kernel, "bad");
                assert_eq!(status, "NVRTC_ERROR_COMPILATION");
                assert!(log.contains("undefined_name"), "{log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }

    #[test]
    fn status_names_are_readable() {
        assert_eq!(
            nvrtc_status_name(nvrtc::nvrtcResult::NVRTC_ERROR_COMPILATION),
            "NVRTC_ERROR_COMPILATION"
        );
    }
}
