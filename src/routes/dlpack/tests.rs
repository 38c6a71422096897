//! Unit tests of the DLPack layer that need no engine.

use super::*;

#[test]
fn every_element_type_maps_to_a_dlpack_type_and_back() {
    for dtype in DType::ALL {
        assert_eq!(dtype_of(dl_dtype(dtype)), Some(dtype), "{dtype}");
    }
    let vector = ffi::DLDataType {
        code: ffi::DL_FLOAT,
        bits: 32,
        lanes: 4,
    };
    assert_eq!(dtype_of(vector), None);
}
