//! `launcher doctor` on GPU ranks: the GPU's links from the driver (name, PCI address, peer
//! access to the other GPUs it sees) and sysfs (the PCIe link's speed and width), and the
//! measurement over an NCCL communicator like training's (device buffers, one stream).
//!
//! Built with the `cuda` feature; without it a GPU doctor run is refused before any rank
//! starts (`gpu::preflight`), and these answer so.

#[cfg(feature = "cuda")]
mod imp {
    use super::super::hardware::{nvlink_of, pcie_gbps, GpuLinks};
    use super::super::measure::{self, Measured, Net};
    use super::super::spec::Spec;
    use collectives::nccl::{NcclAbort, NcclComm};
    use collectives::progress::Progress;
    use collectives::{Communicator, Group, ReduceOp};
    use cudarc::driver::sys::CUdevice_attribute as A;
    use cudarc::driver::{result::device, CudaContext, CudaSlice, CudaStream};
    use std::sync::Arc;

    /// What the driver and sysfs say about GPU `gpu`'s links (`None` if the driver does not answer).
    pub fn links_of(gpu: usize) -> Option<GpuLinks> {
        cudarc::driver::result::init().ok()?;
        let dev = device::get(gpu as i32).ok()?;
        let name = device::get_name(dev).unwrap_or_default();
        // SAFETY: a device handle from the driver; integer attributes.
        let attr = |a| unsafe { device::get_attribute(dev, a) }.ok();
        let pci = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        let dir = std::path::Path::new("/sys/bus/pci/devices").join(&pci);
        let speed = std::fs::read_to_string(dir.join("current_link_speed")).ok();
        let width = std::fs::read_to_string(dir.join("current_link_width")).ok();
        let (pcie_gbps, pcie) = match (&speed, &width) {
            (Some(s), Some(w)) => (pcie_gbps(s, w), Some(format!("{} x{}", s.trim(), w.trim()))),
            _ => (None, None),
        };
        let count = device::get_count().unwrap_or(1) as usize;
        let peer_access = (0..count).filter(|&o| o != gpu).all(|o| {
            let Ok(other) = device::get(o as i32) else { return false };
            let mut can = 0i32;
            // SAFETY: two device handles from the driver and a valid out-pointer.
            let r = unsafe { cudarc::driver::sys::cuDeviceCanAccessPeer(&mut can, dev, other) };
            r == cudarc::driver::sys::CUresult::CUDA_SUCCESS && can == 1
        });
        let nvlink_gbps = if peer_access && count > 1 { nvlink_of(&name) } else { None };
        Some(GpuLinks { name, pci, pcie_gbps, pcie, peer_access, nvlink_gbps })
    }

    /// NCCL over device buffers of the size being measured (NCCL calls take whole buffers:
    /// they are made again when the size changes, before the untimed first call).
    struct NcclNet {
        comm: NcclComm,
        stream: Arc<CudaStream>,
        /// Values (all-reduce, and what an exchange sends), the received or gathered values,
        /// and a rank's part of an all-gather; all for `elems`.
        elems: usize,
        a: CudaSlice<f32>,
        b: CudaSlice<f32>,
        part: CudaSlice<f32>,
    }

    fn err(e: impl std::fmt::Display) -> String {
        e.to_string()
    }

    impl NcclNet {
        fn sized(&mut self, elems: usize) -> Result<(), String> {
            if elems != self.elems {
                let world = self.comm.world();
                self.a = self.stream.alloc_zeros::<f32>(elems).map_err(err)?;
                self.b = self.stream.alloc_zeros::<f32>(elems).map_err(err)?;
                self.part = self.stream.alloc_zeros::<f32>((elems / world).max(1)).map_err(err)?;
                self.elems = elems;
            }
            Ok(())
        }
    }

    impl Net for NcclNet {
        fn rank(&self) -> usize {
            self.comm.rank()
        }
        fn world(&self) -> usize {
            self.comm.world()
        }
        fn barrier(&mut self) -> Result<(), String> {
            self.comm.barrier().map_err(err)
        }
        fn all_reduce(&mut self, elems: usize) -> Result<(), String> {
            self.sized(elems)?;
            self.comm.all_reduce(&mut self.a, ReduceOp::Sum).map_err(err)
        }
        fn all_gather(&mut self, elems: usize) -> Result<(), String> {
            self.sized(elems)?;
            self.comm.all_gather(&self.part, &mut self.b).map_err(err)
        }
        fn exchange(&mut self, peer: Option<usize>, elems: usize) -> Result<(), String> {
            self.sized(elems)?;
            self.comm.exchange_with(peer, &self.a, &mut self.b).map_err(err)
        }
        fn sync(&mut self) -> Result<(), String> {
            self.stream.synchronize().map_err(err)
        }
    }

    /// Measure on GPU `gpu` as rank `rank` of `world`, NCCL group from `id`.
    pub fn measure_rank(
        spec: &Spec,
        rank: usize,
        world: usize,
        gpu: usize,
        id: &[u8],
        progress: &Arc<Progress>,
    ) -> Result<Measured, String> {
        let ctx = CudaContext::new(gpu).map_err(|e| format!("GPU {gpu}: {e}"))?;
        let stream = ctx.default_stream();
        let abort = NcclAbort::new();
        let on_stop = abort.clone();
        crate::signals::on_stop(move || {
            let _ = on_stop.abort();
        });
        let comm = NcclComm::new_abortable(stream.clone(), rank, world, id, &abort).map_err(err)?;
        let one = || stream.alloc_zeros::<f32>(1).map_err(err);
        let (a, b, part) = (one()?, one()?, one()?);
        let mut net = NcclNet { comm, stream: stream.clone(), elems: 1, a, b, part };
        // About 4 GiB per timed size: 3 calls of 1 GiB, 20 of 16 MiB.
        measure::run(&mut net, spec, 4 << 30, progress)
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::super::hardware::GpuLinks;
    use super::super::measure::Measured;
    use super::super::spec::Spec;
    use collectives::progress::Progress;
    use std::sync::Arc;

    pub fn links_of(_gpu: usize) -> Option<GpuLinks> {
        None
    }
    pub fn measure_rank(
        _: &Spec,
        _: usize,
        _: usize,
        _: usize,
        _: &[u8],
        _: &Arc<Progress>,
    ) -> Result<Measured, String> {
        Err("launcher doctor --gpus: this launcher was built without the `cuda` feature".into())
    }
}

pub use imp::{links_of, measure_rank};
