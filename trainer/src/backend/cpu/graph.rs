//! The CPU reference runs every op when called: there is no queue to record.

use super::CpuBackend;
use crate::backend::GraphOps;

impl GraphOps for CpuBackend {
    type Graph = ();
}
