//! Memory and copies on the CPU: every role is a `Vec<f32>`, so transfers are copies and
//! the cast to compute precision is the identity.

use super::{alloc, CpuBackend};
use crate::backend::{BResult, Loc, MemoryOps, TokenRole};

impl MemoryOps for CpuBackend {
    fn alloc_buf(&self, n: usize, what: &str) -> BResult<Vec<f32>> {
        alloc(n, what)
    }
    fn alloc_grad(&self, n: usize, what: &str) -> BResult<Vec<f32>> {
        alloc(n, what)
    }
    fn alloc_f32(&self, n: usize, what: &str) -> BResult<Vec<f32>> {
        alloc(n, what)
    }
    fn alloc_tokens(&self, n: usize, _: TokenRole) -> BResult<Vec<u32>> {
        Ok(vec![0; n])
    }
    fn upload_tokens(&self, host: &[u32], dst: &mut Vec<u32>) -> BResult<()> {
        dst[..host.len()].copy_from_slice(host);
        Ok(())
    }
    fn upload_buf(&self, host: &[f32], dst: &mut Vec<f32>, off: usize) -> BResult<()> {
        dst[off..off + host.len()].copy_from_slice(host);
        Ok(())
    }
    fn upload_f32(&self, host: &[f32], dst: &mut Vec<f32>, off: usize) -> BResult<()> {
        dst[off..off + host.len()].copy_from_slice(host);
        Ok(())
    }
    fn download_f32(&self, src: &Vec<f32>, at: Loc) -> BResult<Vec<f32>> {
        Ok(src[at.off..at.end()].to_vec())
    }
    fn download_buf(&self, src: &Vec<f32>, at: Loc) -> BResult<Vec<f32>> {
        Ok(src[at.off..at.end()].to_vec())
    }
    fn download_grad(&self, src: &Vec<f32>, at: Loc) -> BResult<Vec<f32>> {
        Ok(src[at.off..at.end()].to_vec())
    }
    fn cast_to_buf(&self, dst: &mut Vec<f32>, doff: usize, src: &Vec<f32>, at: Loc) -> BResult<()> {
        dst[doff..doff + at.len].copy_from_slice(&src[at.off..at.end()]);
        Ok(())
    }
    fn zero_buf(&self, buf: &mut Vec<f32>, at: Loc) -> BResult<()> {
        buf[at.off..at.end()].fill(0.0);
        Ok(())
    }
    fn zero_grad(&self, buf: &mut Vec<f32>, at: Loc) -> BResult<()> {
        buf[at.off..at.end()].fill(0.0);
        Ok(())
    }
    fn add_grad(&self, dst: &mut Vec<f32>, doff: usize, src: &Vec<f32>, at: Loc) -> BResult<()> {
        for (d, s) in dst[doff..doff + at.len].iter_mut().zip(&src[at.off..at.end()]) {
            *d += *s;
        }
        Ok(())
    }
    fn copy_buf(&self, dst: &mut Vec<f32>, doff: usize, src: &Vec<f32>, at: Loc) -> BResult<()> {
        dst[doff..doff + at.len].copy_from_slice(&src[at.off..at.end()]);
        Ok(())
    }
}
