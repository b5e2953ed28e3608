//! Torch dtypes and storage classes, and what safetensors calls them.

use safetensors::Dtype;

/// One torch dtype: its canonical name (as `torch.NAME` pickles it), its element size in
/// bytes and the safetensors dtype that holds the same bits, if any.
#[derive(Debug, PartialEq, Eq)]
pub struct TorchDtype {
    pub name: &'static str,
    pub size: u8,
    pub safetensors: Option<Dtype>,
}

const fn d(name: &'static str, size: u8, st: Option<Dtype>) -> TorchDtype {
    TorchDtype {
        name,
        size,
        safetensors: st,
    }
}

/// Every dtype torch names, by canonical name ([`by_name`] also knows the aliases).
pub static DTYPES: &[TorchDtype] = &[
    d("float64", 8, Some(Dtype::F64)),
    d("float32", 4, Some(Dtype::F32)),
    d("float16", 2, Some(Dtype::F16)),
    d("bfloat16", 2, Some(Dtype::BF16)),
    d("int64", 8, Some(Dtype::I64)),
    d("int32", 4, Some(Dtype::I32)),
    d("int16", 2, Some(Dtype::I16)),
    d("int8", 1, Some(Dtype::I8)),
    d("uint8", 1, Some(Dtype::U8)),
    d("bool", 1, Some(Dtype::BOOL)),
    d("uint16", 2, Some(Dtype::U16)),
    d("uint32", 4, Some(Dtype::U32)),
    d("uint64", 8, Some(Dtype::U64)),
    d("float8_e4m3fn", 1, Some(Dtype::F8_E4M3)),
    d("float8_e5m2", 1, Some(Dtype::F8_E5M2)),
    d("float8_e8m0fnu", 1, Some(Dtype::F8_E8M0)),
    d("float8_e4m3fnuz", 1, Some(Dtype::F8_E4M3FNUZ)),
    d("float8_e5m2fnuz", 1, Some(Dtype::F8_E5M2FNUZ)),
    d("complex64", 8, Some(Dtype::C64)),
    // Torch has these; safetensors does not (or not with torch's packing).
    d("complex128", 16, None),
    d("complex32", 4, None),
    d("bcomplex32", 4, None),
    d("float4_e2m1fn_x2", 1, None),
    d("qint8", 1, None),
    d("quint8", 1, None),
    d("qint32", 4, None),
    d("quint4x2", 1, None),
    d("quint2x4", 1, None),
    d("bits1x8", 1, None),
    d("bits2x4", 1, None),
    d("bits4x2", 1, None),
    d("bits8", 1, None),
    d("bits16", 2, None),
    d("uint1", 1, None),
    d("uint2", 1, None),
    d("uint3", 1, None),
    d("uint4", 1, None),
    d("uint5", 1, None),
    d("uint6", 1, None),
    d("uint7", 1, None),
    d("int1", 1, None),
    d("int2", 1, None),
    d("int3", 1, None),
    d("int4", 1, None),
    d("int5", 1, None),
    d("int6", 1, None),
    d("int7", 1, None),
];

/// Torch's other names for the same dtypes.
static ALIASES: &[(&str, &str)] = &[
    ("double", "float64"),
    ("float", "float32"),
    ("half", "float16"),
    ("long", "int64"),
    ("int", "int32"),
    ("short", "int16"),
    ("cfloat", "complex64"),
    ("cdouble", "complex128"),
    ("chalf", "complex32"),
];

/// The dtype `torch.NAME` names, if `NAME` is a torch dtype.
pub fn by_name(name: &str) -> Option<&'static TorchDtype> {
    let name = ALIASES
        .iter()
        .find(|(alias, _)| *alias == name)
        .map_or(name, |(_, canonical)| canonical);
    DTYPES.iter().find(|t| t.name == name)
}

/// The legacy typed storage classes (`torch.FloatStorage`, ...) and their dtypes.
static STORAGES: &[(&str, &str)] = &[
    ("DoubleStorage", "float64"),
    ("FloatStorage", "float32"),
    ("HalfStorage", "float16"),
    ("BFloat16Storage", "bfloat16"),
    ("LongStorage", "int64"),
    ("IntStorage", "int32"),
    ("ShortStorage", "int16"),
    ("CharStorage", "int8"),
    ("ByteStorage", "uint8"),
    ("BoolStorage", "bool"),
    ("ComplexFloatStorage", "complex64"),
    ("ComplexDoubleStorage", "complex128"),
    ("QInt8Storage", "qint8"),
    ("QUInt8Storage", "quint8"),
    ("QInt32Storage", "qint32"),
    ("QUInt4x2Storage", "quint4x2"),
    ("QUInt2x4Storage", "quint2x4"),
];

/// The dtype of the typed storage class `torch.NAME` (or `torch.cuda.NAME`).
pub fn storage_class(name: &str) -> Option<&'static TorchDtype> {
    let (_, dtype) = STORAGES.iter().find(|(class, _)| *class == name)?;
    by_name(dtype)
}

/// `uint8`, the dtype of an untyped storage.
pub fn uint8() -> &'static TorchDtype {
    &DTYPES[8]
}

/// The unit within which bytes are reversed when a big-endian storage is read: the element
/// size, except for complex numbers, whose two halves are swapped separately.
pub fn swap_unit(dtype: Dtype) -> usize {
    match dtype {
        Dtype::C64 => 4,
        other => other.bitsize() / 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_agree() {
        assert_eq!(uint8().name, "uint8");
        for t in DTYPES {
            if let Some(st) = t.safetensors {
                assert_eq!(st.bitsize(), usize::from(t.size) * 8, "{}", t.name);
            }
            assert!(std::ptr::eq(by_name(t.name).unwrap(), t));
        }
        for (alias, canonical) in ALIASES {
            assert_eq!(by_name(alias).unwrap().name, *canonical);
        }
        for (class, _) in STORAGES {
            assert!(storage_class(class).is_some(), "{class}");
        }
        assert_eq!(by_name("cfloat").unwrap().safetensors, Some(Dtype::C64));
        assert!(by_name("bit").is_none());
    }
}
