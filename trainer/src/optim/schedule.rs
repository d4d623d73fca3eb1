//! Learning-rate schedule: linear warmup, then cosine decay to `min_lr` at the last step.

/// Learning rate for 0-based `step` of `total` steps.
pub fn lr_at(step: usize, total: usize, warmup: usize, lr: f32, min_lr: f32) -> f32 {
    if step < warmup {
        return lr * (step + 1) as f32 / warmup as f32;
    }
    let decay_steps = total.saturating_sub(warmup).max(1);
    let progress = ((step - warmup) as f32 / decay_steps as f32).min(1.0);
    let coeff = 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
    min_lr + coeff * (lr - min_lr)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn warmup_then_cosine() {
        assert!((lr_at(0, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-6);
        assert!((lr_at(9, 100, 10, 1.0, 0.1) - 1.0).abs() < 1e-6);
        assert!((lr_at(10, 100, 10, 1.0, 0.1) - 1.0).abs() < 1e-6);
        assert!((lr_at(100, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-6);
        let mid = lr_at(55, 100, 10, 1.0, 0.1);
        assert!((mid - 0.55).abs() < 1e-3, "{mid}");
    }
}
