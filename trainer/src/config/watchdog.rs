//! `[watchdog]`: the launcher's hang watchdog and the ranks' flight recorders.

use super::{bad, ConfigError};
use serde::{Deserialize, Serialize};

/// The launcher's hang watchdog (read by the launcher; ranks report their progress).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WatchdogConfig {
    /// Stop the job when no rank has made progress (a micro-step, a collective entered or
    /// left, a step, a checkpoint being written) for this many seconds. 0 turns it off.
    pub timeout_s: f64,
    /// Collectives each rank's flight recorder keeps (its last ones), reported when the job
    /// hangs or a rank fails. 0 records none.
    pub flight_records: usize,
}

/// The most collectives a flight recorder may keep: a rank sends them in one control message.
pub const MAX_FLIGHT_RECORDS: usize = 16384;

impl Default for WatchdogConfig {
    fn default() -> Self {
        WatchdogConfig { timeout_s: 120.0, flight_records: 64 }
    }
}

impl WatchdogConfig {
    /// A timeout in seconds; no more flight records than one message holds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let w = self.timeout_s;
        if !(w.is_finite() && w >= 0.0) {
            return Err(bad("watchdog.timeout_s", w, "must be a number of seconds >= 0 (0 turns the watchdog off)"));
        }
        if self.flight_records > MAX_FLIGHT_RECORDS {
            return Err(bad(
                "watchdog.flight_records",
                self.flight_records,
                format!(
                    "must be at most {MAX_FLIGHT_RECORDS} (a rank sends its records in one message; the first \
                     divergence is almost always among the last few dozen)"
                ),
            ));
        }
        Ok(())
    }
}
