//! Choices between equivalent forms of one computation that no fixed rule gets right on every
//! backend (what MLX's CUDA kernels favour, Metal's may not): each is settled once per loaded
//! model by timing the forms on the first real input that offers the choice, then kept for
//! all of the model's layers. Only GPUs time; the CPU backend keeps the first form (the one
//! the reference tests check against mlx-lm).

use std::fmt::Debug;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use crate::device::on_gpu;
use crate::error::Result;

/// One loaded model's choice of form, shared by its layers.
#[derive(Debug, Clone)]
pub struct Measured<T>(Arc<OnceLock<T>>);

impl<T> Default for Measured<T> {
    fn default() -> Self {
        Measured(Arc::new(OnceLock::new()))
    }
}

/// A form and how to compute it (its outputs are evaluated to time it).
pub type Form<'a, T> = (T, &'a dyn Fn() -> Result<Vec<Array>>);

impl<T: Copy + Debug> Measured<T> {
    /// A choice made beforehand (a benchmark's override): nothing is timed.
    pub fn kept(form: T) -> Self {
        Measured(Arc::new(OnceLock::from(form)))
    }

    /// The kept form, if settled.
    pub fn get(&self) -> Option<T> {
        self.0.get().copied()
    }

    /// The kept form; else, on a GPU, the fastest of `forms` on this input (each run once
    /// untimed so its kernels compile, then once timed; a form that fails counts as never
    /// fastest), kept from now on; on the CPU the first form, not kept (nothing is timed).
    pub fn choose(&self, what: &str, forms: &[Form<'_, T>]) -> Result<T> {
        if let Some(kept) = self.0.get() {
            return Ok(*kept);
        }
        let Some(&(first, _)) = forms.first() else {
            return Err(Exception::custom(format!("{what}: no form to choose from")).into());
        };
        if !on_gpu() {
            return Ok(first);
        }
        let times: Vec<(T, f64)> = forms
            .iter()
            .map(|(form, run)| {
                let ms = time(*run).unwrap_or_else(|e| {
                    tracing::warn!("{what}: {form:?} failed ({e}); not using it");
                    f64::INFINITY
                });
                (*form, ms)
            })
            .collect();
        self.settle(what, &times)
    }

    /// Keeps the fastest of `times` (ms by form), unless every form failed.
    pub fn settle(&self, what: &str, times: &[(T, f64)]) -> Result<T> {
        let fastest = times.iter().filter(|(_, ms)| ms.is_finite()).min_by(|a, b| a.1.total_cmp(&b.1));
        let Some(&(form, _)) = fastest else {
            return Err(Exception::custom(format!("{what}: every form failed")).into());
        };
        let listed: Vec<String> = times.iter().map(|(form, ms)| format!("{form:?} {ms:.1} ms")).collect();
        tracing::info!("{what}: {}: using {form:?}", listed.join(", "));
        Ok(*self.0.get_or_init(|| form))
    }
}

fn time(run: &dyn Fn() -> Result<Vec<Array>>) -> Result<f64> {
    mlx_rs::transforms::eval(&run()?)?;
    let started = Instant::now();
    mlx_rs::transforms::eval(&run()?)?;
    Ok(started.elapsed().as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Form {
        A,
        B,
    }

    #[test]
    fn the_fastest_form_is_kept_for_every_layer() {
        let model = Measured::default();
        let other_layer = model.clone();
        assert_eq!(model.settle("test", &[(Form::A, 21.8), (Form::B, 4.7)]).unwrap(), Form::B);
        // Settled: another layer of the same model neither times again nor changes its mind.
        let not_again = || -> Result<Vec<Array>> { panic!("timed twice") };
        assert_eq!(other_layer.choose("test", &[(Form::A, &not_again)]).unwrap(), Form::B);
    }

    #[test]
    fn a_failed_form_never_wins_and_all_failing_is_an_error() {
        assert_eq!(Measured::default().settle("test", &[(Form::A, 3.0), (Form::B, f64::INFINITY)]).unwrap(), Form::A);
        let err = Measured::<Form>::default().settle("test", &[(Form::A, f64::INFINITY)]).unwrap_err();
        assert!(err.to_string().contains("every form failed"), "{err}");
    }

    #[test]
    fn forms_run_and_are_timed_on_a_gpu_only() {
        let runs = std::cell::Cell::new(0);
        let run = || -> Result<Vec<Array>> {
            runs.set(runs.get() + 1);
            Ok(vec![Array::from_f32(1.0).add(Array::from_f32(2.0))?])
        };
        let chosen = Measured::default().choose("test", &[(Form::A, &run), (Form::B, &run)]).unwrap();
        if on_gpu() {
            assert_eq!(runs.get(), 4, "each form once untimed, once timed");
        } else {
            assert_eq!((chosen, runs.get()), (Form::A, 0), "the CPU keeps the first form untimed");
        }
    }
}
