//! Fans, temperatures and the thermal state. Linux reads sysfs (`/sys/class/hwmon/*/fanN_input`,
//! `tempN_input`, `/sys/class/thermal/thermal_zone*/temp`); macOS reads fan speeds from the SMC
//! ([`crate::smc`]) and asks the OS for its thermal state. What a machine does not expose stays empty or `None`: these VMs have neither fans nor
//! sensors, and the UI says "not available".

use std::path::Path;

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fan {
    pub label: String,
    pub rpm: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sensor {
    pub label: String,
    pub celsius: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Thermal {
    pub fans: Vec<Fan>,
    pub temperatures: Vec<Sensor>,
    /// macOS: nominal, fair, serious or critical.
    pub state: Option<String>,
}

impl Thermal {
    pub fn available(&self) -> bool {
        !self.fans.is_empty() || !self.temperatures.is_empty() || self.state.is_some()
    }
}

/// Fans as the window shows them ("Fan 1", …) from (fan index, rpm) readings.
pub fn fans_from_speeds(speeds: Vec<(usize, u64)>) -> Vec<Fan> {
    speeds.into_iter().map(|(i, rpm)| Fan { label: format!("Fan {}", i + 1), rpm }).collect()
}

/// Reads this machine's figures.
pub fn read() -> Thermal {
    #[cfg(target_os = "macos")]
    {
        let fans = crate::smc::iokit::Smc::open()
            .map(|smc| fans_from_speeds(crate::smc::fan_speeds(|key| smc.read_key(key))))
            .unwrap_or_default();
        Thermal { fans, temperatures: vec![], state: macos::thermal_state() }
    }
    #[cfg(not(target_os = "macos"))]
    {
        read_sysfs(Path::new("/sys/class"))
    }
}

fn read_number(path: &Path) -> Option<i64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn read_text(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// Fans and sensors under a sysfs `class` folder (a parameter so tests can build one).
pub fn read_sysfs(class: &Path) -> Thermal {
    let mut t = Thermal::default();
    let mut hwmons: Vec<_> =
        std::fs::read_dir(class.join("hwmon")).into_iter().flatten().flatten().map(|e| e.path()).collect();
    hwmons.sort();
    for hw in hwmons {
        let chip = read_text(&hw.join("name"))
            .unwrap_or_else(|| hw.file_name().unwrap_or_default().to_string_lossy().into_owned());
        let mut files: Vec<_> = std::fs::read_dir(&hw)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        for f in &files {
            let Some(stem) = f.strip_suffix("_input") else { continue };
            let label = read_text(&hw.join(format!("{stem}_label"))).unwrap_or_else(|| format!("{chip} {stem}"));
            match read_number(&hw.join(f)) {
                Some(v) if stem.starts_with("fan") => t.fans.push(Fan { label, rpm: v.max(0) as u64 }),
                Some(v) if stem.starts_with("temp") => {
                    t.temperatures.push(Sensor { label, celsius: v as f64 / 1000.0 })
                }
                _ => {}
            }
        }
    }
    let mut zones: Vec<_> = std::fs::read_dir(class.join("thermal"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("thermal_zone")))
        .collect();
    zones.sort();
    for z in zones {
        if let Some(milli) = read_number(&z.join("temp")) {
            let label = read_text(&z.join("type"))
                .unwrap_or_else(|| z.file_name().unwrap_or_default().to_string_lossy().into_owned());
            t.temperatures.push(Sensor { label, celsius: milli as f64 / 1000.0 });
        }
    }
    t
}

#[cfg(target_os = "macos")]
mod macos {
    use objc2_foundation::{NSProcessInfo, NSProcessInfoThermalState};

    /// `NSProcessInfo.thermalState`, as Activity Monitor and the OS's own throttling see it.
    pub fn thermal_state() -> Option<String> {
        #[allow(unused_unsafe)]
        let state = unsafe { NSProcessInfo::processInfo().thermalState() };
        let name = if state == NSProcessInfoThermalState::Nominal {
            "nominal"
        } else if state == NSProcessInfoThermalState::Fair {
            "fair"
        } else if state == NSProcessInfoThermalState::Serious {
            "serious"
        } else if state == NSProcessInfoThermalState::Critical {
            "critical"
        } else {
            return None;
        };
        Some(name.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fans_and_sensors_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        let hw = dir.path().join("hwmon/hwmon0");
        std::fs::create_dir_all(&hw).unwrap();
        std::fs::write(hw.join("name"), "nct6775\n").unwrap();
        std::fs::write(hw.join("fan1_input"), "1234\n").unwrap();
        std::fs::write(hw.join("fan1_label"), "CPU fan\n").unwrap();
        std::fs::write(hw.join("fan2_input"), "800\n").unwrap();
        std::fs::write(hw.join("temp1_input"), "45500\n").unwrap();
        let zone = dir.path().join("thermal/thermal_zone0");
        std::fs::create_dir_all(&zone).unwrap();
        std::fs::write(zone.join("type"), "x86_pkg_temp\n").unwrap();
        std::fs::write(zone.join("temp"), "51000\n").unwrap();
        let t = read_sysfs(dir.path());
        assert_eq!(
            t.fans,
            vec![Fan { label: "CPU fan".into(), rpm: 1234 }, Fan { label: "nct6775 fan2".into(), rpm: 800 }]
        );
        assert_eq!(t.temperatures[0], Sensor { label: "nct6775 temp1".into(), celsius: 45.5 });
        assert_eq!(t.temperatures[1].label, "x86_pkg_temp");
        assert!(t.available());
    }

    #[test]
    fn nothing_exposed_means_not_available() {
        let dir = tempfile::tempdir().unwrap();
        let t = read_sysfs(dir.path());
        assert!(!t.available() && t.fans.is_empty() && t.state.is_none());
    }
}
