//! Fan speeds from the System Management Controller, as macOS exposes it to user programs:
//! the `AppleSMC` IOKit service, whose user client answers a fixed 80-byte request struct.
//! The protocol (struct layout, key codes, value encodings) is plain data and compiles and is
//! tested everywhere; only the IOKit calls in [`iokit`] are macOS's.

/// The request and answer of the SMC user client (`SMCKeyData_t` of Apple's `smc.h`, as
/// smcFanControl and every fan tool use it).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyData {
    pub key: u32,
    pub vers: [u8; 6],
    pub p_limit: PLimitData,
    pub key_info: KeyInfo,
    pub result: u8,
    pub status: u8,
    /// The command: [`READ_BYTES`] or [`READ_KEY_INFO`].
    pub data8: u8,
    pub data32: u32,
    pub bytes: [u8; 32],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PLimitData {
    pub version: u16,
    pub length: u16,
    pub cpu_p_limit: u32,
    pub gpu_p_limit: u32,
    pub mem_p_limit: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyInfo {
    pub data_size: u32,
    pub data_type: u32,
    pub data_attributes: u8,
}

// The user client checks the struct's size: it must be the C one, byte for byte.
const _: () = assert!(std::mem::size_of::<KeyData>() == 80);
const _: () = assert!(std::mem::offset_of!(KeyData, key_info) == 28);
const _: () = assert!(std::mem::offset_of!(KeyData, data8) == 42);
const _: () = assert!(std::mem::offset_of!(KeyData, bytes) == 48);

/// The user client's method for every command, and the two commands used here.
pub const KERNEL_INDEX_SMC: u32 = 2;
pub const READ_BYTES: u8 = 5;
pub const READ_KEY_INFO: u8 = 9;

/// A four-character key (`FNum`, `F0Ac`) as the SMC numbers it: big-endian ASCII.
pub fn key_code(name: &str) -> Option<u32> {
    let b = name.as_bytes();
    (b.len() == 4 && b.is_ascii()).then(|| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// A value in one of the encodings fan keys use: `flt ` (Apple silicon: little-endian f32),
/// `fpe2` (Intel: big-endian unsigned fixed point, 2 fraction bits), `ui8 `, `ui16`.
pub fn decode(data_type: u32, bytes: &[u8]) -> Option<f64> {
    let kind = data_type.to_be_bytes();
    match &kind {
        b"flt " => Some(f32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as f64),
        b"fpe2" => Some(u16::from_be_bytes(bytes.get(..2)?.try_into().ok()?) as f64 / 4.0),
        b"ui8 " => bytes.first().map(|b| *b as f64),
        b"ui16" => Some(u16::from_be_bytes(bytes.get(..2)?.try_into().ok()?) as f64),
        _ => None,
    }
}

/// The fans' speeds as (fan index, rpm), given a way to read a key's (type, bytes): the count
/// from `FNum`, then each fan's actual speed `F{i}Ac`. A machine without fans (a MacBook Air)
/// reports none.
pub fn fan_speeds(mut read_key: impl FnMut(&str) -> Option<(u32, Vec<u8>)>) -> Vec<(usize, u64)> {
    let count = read_key("FNum").and_then(|(t, b)| decode(t, &b)).unwrap_or(0.0) as usize;
    (0..count.min(10))
        .filter_map(|i| {
            let (t, b) = read_key(&format!("F{i}Ac"))?;
            let rpm = decode(t, &b)?;
            (rpm.is_finite() && rpm >= 0.0).then(|| (i, rpm.round() as u64))
        })
        .collect()
}

#[cfg(target_os = "macos")]
pub mod iokit {
    //! The IOKit calls: open the `AppleSMC` service, send [`KeyData`] requests, close.
    use std::ffi::{c_char, c_void};

    use super::{key_code, KeyData, KERNEL_INDEX_SMC, READ_BYTES, READ_KEY_INFO};

    type KernReturn = i32;
    type MachPort = u32;

    #[link(name = "IOKit", kind = "framework")]
    extern "C" {
        fn IOServiceMatching(name: *const c_char) -> *mut c_void;
        fn IOServiceGetMatchingService(main_port: MachPort, matching: *mut c_void) -> MachPort;
        fn IOServiceOpen(service: MachPort, owning_task: MachPort, kind: u32, connect: *mut MachPort) -> KernReturn;
        fn IOServiceClose(connect: MachPort) -> KernReturn;
        fn IOObjectRelease(object: MachPort) -> KernReturn;
        fn IOConnectCallStructMethod(
            connection: MachPort,
            selector: u32,
            input: *const c_void,
            input_size: usize,
            output: *mut c_void,
            output_size: *mut usize,
        ) -> KernReturn;
    }

    extern "C" {
        /// What C's `mach_task_self()` macro reads.
        static mach_task_self_: MachPort;
    }

    /// An open connection to the SMC, closed on drop.
    pub struct Smc {
        connection: MachPort,
    }

    impl Smc {
        pub fn open() -> Option<Smc> {
            // SAFETY: IOServiceMatching copies the C string and returns a dictionary that
            // IOServiceGetMatchingService consumes (releases); the service handle is released
            // after IOServiceOpen, which keeps its own reference in the connection.
            unsafe {
                let matching = IOServiceMatching(c"AppleSMC".as_ptr());
                if matching.is_null() {
                    return None;
                }
                let service = IOServiceGetMatchingService(0, matching);
                if service == 0 {
                    return None;
                }
                let mut connection: MachPort = 0;
                let opened = IOServiceOpen(service, mach_task_self_, 0, &mut connection);
                IOObjectRelease(service);
                (opened == 0 && connection != 0).then_some(Smc { connection })
            }
        }

        fn call(&self, input: &KeyData) -> Option<KeyData> {
            let mut output = KeyData::default();
            let mut size = std::mem::size_of::<KeyData>();
            // SAFETY: both buffers are `KeyData`, the exact struct the user client expects,
            // and `size` says how much of `output` it may write.
            let status = unsafe {
                IOConnectCallStructMethod(
                    self.connection,
                    KERNEL_INDEX_SMC,
                    (input as *const KeyData).cast(),
                    std::mem::size_of::<KeyData>(),
                    (&mut output as *mut KeyData).cast(),
                    &mut size,
                )
            };
            (status == 0 && output.result == 0).then_some(output)
        }

        /// A key's type and bytes.
        pub fn read_key(&self, name: &str) -> Option<(u32, Vec<u8>)> {
            let key = key_code(name)?;
            let info = self.call(&KeyData { key, data8: READ_KEY_INFO, ..Default::default() })?.key_info;
            let size = (info.data_size as usize).min(32);
            let request = KeyData { key, key_info: info, data8: READ_BYTES, ..Default::default() };
            let answer = self.call(&request)?;
            Some((info.data_type, answer.bytes[..size].to_vec()))
        }
    }

    impl Drop for Smc {
        fn drop(&mut self) {
            // SAFETY: the connection came from IOServiceOpen and is closed once.
            unsafe {
                IOServiceClose(self.connection);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::thermal::{fans_from_speeds, Fan};

    #[test]
    fn keys_are_big_endian_ascii() {
        assert_eq!(key_code("FNum"), Some(0x464e_756d));
        assert_eq!(key_code("F0Ac"), Some(u32::from_be_bytes(*b"F0Ac")));
        assert_eq!(key_code("toolong"), None);
    }

    #[test]
    fn fan_values_decode_in_both_encodings() {
        let flt = u32::from_be_bytes(*b"flt ");
        let fpe2 = u32::from_be_bytes(*b"fpe2");
        assert_eq!(decode(flt, &1830.5f32.to_le_bytes()), Some(1830.5));
        // 2000 rpm in 14.2 fixed point: 8000 = 0x1f40.
        assert_eq!(decode(fpe2, &[0x1f, 0x40]), Some(2000.0));
        assert_eq!(decode(u32::from_be_bytes(*b"ui8 "), &[2]), Some(2.0));
        assert_eq!(decode(u32::from_be_bytes(*b"sp78"), &[1, 2]), None);
        assert_eq!(decode(flt, &[1, 2]), None, "too few bytes");
    }

    #[test]
    fn fans_are_read_by_count_then_speed() {
        let flt = u32::from_be_bytes(*b"flt ");
        let fans = fans_from_speeds(fan_speeds(|key| match key {
            "FNum" => Some((u32::from_be_bytes(*b"ui8 "), vec![2])),
            "F0Ac" => Some((flt, 1200.4f32.to_le_bytes().to_vec())),
            "F1Ac" => Some((flt, 2411.6f32.to_le_bytes().to_vec())),
            _ => None,
        }));
        assert_eq!(fans, vec![Fan { label: "Fan 1".into(), rpm: 1200 }, Fan { label: "Fan 2".into(), rpm: 2412 }]);
        // No fans (or no SMC answer): none reported, nothing made up.
        assert!(fan_speeds(|_| None).is_empty());
    }
}
