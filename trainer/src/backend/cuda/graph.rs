//! CUDA graphs on the compute stream (twin: cpu/graph.rs, which records nothing). Capture
//! is thread-local: only this rank thread's calls on the stream are recorded, and a call
//! that cannot be recorded (a synchronisation, an allocation outside the pool) fails the
//! capture instead of running.

use cudarc::driver::{sys, CudaGraph};

use super::CudaBackend;
use crate::backend::{BResult, BackendError, GraphOps};

impl GraphOps for CudaBackend {
    type Graph = CudaGraph;

    fn graphs_supported(&self) -> bool {
        true
    }
    fn begin_capture(&self) -> BResult<()> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| self.err("starting a graph capture", e))
    }
    fn end_capture(&self) -> BResult<CudaGraph> {
        self.stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| self.err("ending a graph capture", e))?
            .ok_or_else(|| BackendError::Device(format!("graph capture on {} recorded nothing", self.device)))
    }
    fn replay(&self, g: &CudaGraph) -> BResult<()> {
        g.launch().map_err(|e| self.err("replaying a graph", e))
    }
}
