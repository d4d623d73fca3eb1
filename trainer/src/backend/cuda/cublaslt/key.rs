//! A GEMM's plan key (shape, layouts, types, epilogue, pointer alignment), in words for
//! the tools and as the stored table records it.

use super::*;

/// Largest power of two (up to 256) dividing the address: what cuBLASLt may assume.
pub(super) fn alignment(p: u64) -> u32 {
    let mut a = 256u32;
    while a > 1 && !p.is_multiple_of(a as u64) {
        a /= 2;
    }
    a
}

/// A GEMM in words: its shape, transposes, output type, epilogue and beta.
pub(super) fn describe(key: &Key, g: &Gemm) -> String {
    let fp8 = match key.fp8 {
        Some((a, b, fast)) => format!(" fp8={a:?}x{b:?}{}", if fast { " fast-accum" } else { "" }),
        None => String::new(),
    };
    format!(
        "m={} n={} k={} {}{} out={:?} bias={} act={:?} beta={}{fp8}",
        key.m,
        key.n,
        key.k,
        if key.transa { 'T' } else { 'N' },
        if key.transb { 'T' } else { 'N' },
        key.out,
        key.bias,
        key.act,
        g.beta
    )
}

/// A plan key as the stored table records it.
pub(super) fn shape_of(key: &Key) -> GemmShape {
    let fp8 = |f: Fp8Format| match f {
        Fp8Format::E4M3 => GemmType::E4m3,
        Fp8Format::E5M2 => GemmType::E5m2,
    };
    let (a_type, b_type, fast_accum) = match key.fp8 {
        Some((a, b, fast)) => (fp8(a), fp8(b), fast),
        None => (GemmType::Bf16, GemmType::Bf16, false),
    };
    GemmShape {
        transa: key.transa,
        transb: key.transb,
        m: key.m,
        n: key.n,
        k: key.k,
        lda: key.lda,
        ldb: key.ldb,
        ldd: key.ldd,
        a_type,
        b_type,
        d_type: match key.out {
            OutType::Bf16 => GemmType::Bf16,
            OutType::F32 => GemmType::F32,
        },
        bias: key.bias,
        epilogue: match key.act {
            Act::None => GemmEpilogue::None,
            Act::Gelu => GemmEpilogue::Gelu,
            Act::DGelu => GemmEpilogue::Dgelu,
        },
        fast_accum,
        align: key.align,
    }
}

/// The plan key of a stored shape; `None` for a combination this backend never runs.
pub(super) fn key_of(s: &GemmShape) -> Option<Key> {
    let fp8 = |t: GemmType| match t {
        GemmType::E4m3 => Some(Fp8Format::E4M3),
        GemmType::E5m2 => Some(Fp8Format::E5M2),
        _ => None,
    };
    let fp8 = match (s.a_type, s.b_type) {
        (GemmType::Bf16, GemmType::Bf16) if !s.fast_accum => None,
        (a, b) => Some((fp8(a)?, fp8(b)?, s.fast_accum)),
    };
    Some(Key {
        transa: s.transa,
        transb: s.transb,
        m: s.m,
        n: s.n,
        k: s.k,
        lda: s.lda,
        ldb: s.ldb,
        ldd: s.ldd,
        out: match s.d_type {
            GemmType::Bf16 => OutType::Bf16,
            GemmType::F32 => OutType::F32,
            _ => return None,
        },
        bias: s.bias,
        act: match s.epilogue {
            GemmEpilogue::None => Act::None,
            GemmEpilogue::Gelu => Act::Gelu,
            GemmEpilogue::Dgelu => Act::DGelu,
        },
        fp8,
        align: s.align,
    })
}

impl Lt {
    pub(super) fn key(g: &Gemm) -> Key {
        Key {
            transa: g.transa,
            transb: g.transb,
            m: g.m,
            n: g.n,
            k: g.k,
            lda: g.lda,
            ldb: g.ldb,
            ldd: g.ldd,
            out: g.out,
            bias: g.bias.is_some(),
            act: g.act,
            fp8: g.fp8.map(|f| (f.a, f.b, f.fast_accum)),
            align: [
                alignment(g.a),
                alignment(g.b),
                alignment(g.d),
                g.bias.map_or(256, alignment),
                g.aux.map_or(256, alignment),
                g.c.map_or(256, alignment),
            ],
        }
    }
}
