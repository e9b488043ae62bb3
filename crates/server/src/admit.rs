//! Whether a prompt fits, and how long its answer may be: the model's context, the memory left
//! beside the model for the KV cache, and the server's cap, decided from plain figures (the
//! engine thread reads them; the decision needs no model).

use crate::job::{Clamp, ClampedBy, JobError, NOT_ASKED};

/// What a request must fit in, as the engine thread sees it when the request comes.
#[derive(Debug, Clone, Copy)]
pub struct Room {
    /// The model's context, in tokens.
    pub context: usize,
    /// The most memory the model and its caches may take.
    pub memory_budget: u64,
    /// What MLX holds now (the weights, the prompt cache, a kept cache).
    pub held: u64,
    /// What one more token of context takes in the KV caches.
    pub kv_bytes_per_token: u64,
    /// The server's cap on an answer (`--max-output-tokens`).
    pub cap: Option<usize>,
}

impl Room {
    /// Tokens of KV cache the memory left beside the model holds.
    pub fn memory_tokens(&self) -> usize {
        let free = self.memory_budget.saturating_sub(self.held);
        (free / self.kv_bytes_per_token.max(1)).min(usize::MAX as u64) as usize
    }

    /// Why a prompt does not fit the memory left: the figures a user can act on.
    fn memory_says(&self) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        format!(
            "the memory left beside the model ({:.2} GB of a {:.1} GB budget, {:.2} GB held) holds the KV cache of {} \
             tokens at {} bytes a token: it does not fit (a smaller model, or a larger --max-memory-gb)",
            gb(self.memory_budget.saturating_sub(self.held)),
            gb(self.memory_budget),
            gb(self.held),
            self.memory_tokens(),
            self.kv_bytes_per_token
        )
    }

    /// Before the template renders it: a prompt whose text alone is at least `least` tokens
    /// (`text_bytes` bytes) is refused when it cannot fit the context, or the memory (unless
    /// it is only counted).
    pub fn check_text(&self, least: usize, text_bytes: usize, count_only: bool) -> Result<(), JobError> {
        if least >= self.memory_tokens() && !count_only {
            return Err(JobError::BadRequest(format!(
                "the prompt is at least {least} tokens ({text_bytes} bytes of text): {}",
                self.memory_says()
            )));
        }
        if least >= self.context {
            let size = format!("at least {least} tokens ({text_bytes} bytes of text)");
            return Err(JobError::too_long(least, &size, self.context));
        }
        Ok(())
    }

    /// The rendered prompt of `prompt_tokens` → the most tokens its answer may take: `asked`
    /// ([`NOT_ASKED`]: all that fits), or less where the context, the memory or the cap leave
    /// less (agents ask for more than any context leaves: they get what fits), and what
    /// lowered it. A prompt that leaves no room is refused.
    pub fn answer_budget(&self, prompt_tokens: usize, asked: usize) -> Result<(usize, Option<Clamp>), JobError> {
        if prompt_tokens >= self.context {
            return Err(JobError::too_long(prompt_tokens, &format!("{prompt_tokens} tokens"), self.context));
        }
        let memory_tokens = self.memory_tokens();
        if prompt_tokens >= memory_tokens {
            return Err(JobError::BadRequest(format!("the prompt is {prompt_tokens} tokens: {}", self.memory_says())));
        }
        let (context_room, memory_room) = (self.context - prompt_tokens, memory_tokens - prompt_tokens);
        let cap = self.cap.unwrap_or(usize::MAX);
        let room = context_room.min(memory_room).min(cap);
        let by = if cap == room {
            ClampedBy::ServerCap
        } else if memory_room < context_room {
            ClampedBy::Memory
        } else {
            ClampedBy::Context
        };
        Ok(match asked > room {
            true => (room, Some(Clamp { asked: (asked != NOT_ASKED).then_some(asked), by })),
            false => (asked, None),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4,096 tokens of context; 1,000 bytes a token with 2 MB free: 2,000 tokens of memory.
    fn room(cap: Option<usize>) -> Room {
        Room { context: 4096, memory_budget: 10_000_000, held: 8_000_000, kv_bytes_per_token: 1000, cap }
    }

    #[test]
    fn an_answer_gets_what_it_asked_when_that_fits() {
        assert_eq!(room(None).answer_budget(100, 500).unwrap(), (500, None));
    }

    #[test]
    fn what_lowers_an_answer_is_named() {
        let memory = room(None).answer_budget(1000, 5000).unwrap();
        assert_eq!(memory, (1000, Some(Clamp { asked: Some(5000), by: ClampedBy::Memory })));
        let roomy = Room { memory_budget: 100_000_000, ..room(None) };
        let context = roomy.answer_budget(1000, 5000).unwrap();
        assert_eq!(context, (3096, Some(Clamp { asked: Some(5000), by: ClampedBy::Context })));
        let cap = room(Some(64)).answer_budget(1000, 5000).unwrap();
        assert_eq!(cap, (64, Some(Clamp { asked: Some(5000), by: ClampedBy::ServerCap })));
        // Nothing asked: all that fits, said as chosen by the server.
        let chosen = room(None).answer_budget(1000, NOT_ASKED).unwrap();
        assert_eq!(chosen, (1000, Some(Clamp { asked: None, by: ClampedBy::Memory })));
    }

    #[test]
    fn a_prompt_that_leaves_no_room_is_refused_by_what_it_overflows() {
        let too_long = room(None).answer_budget(4096, 10).unwrap_err();
        assert!(matches!(too_long, JobError::TooLong { prompt_tokens: 4096, context: 4096, .. }), "{too_long:?}");
        let JobError::BadRequest(memory) = room(None).answer_budget(2000, 10).unwrap_err() else { panic!() };
        assert!(memory.contains("2000 tokens at 1000 bytes a token"), "{memory}");
        // The text alone: the memory first (unless only counted), then the context.
        assert!(matches!(room(None).check_text(2500, 9000, false), Err(JobError::BadRequest(_))));
        assert!(room(None).check_text(2500, 9000, true).is_ok());
        assert!(matches!(room(None).check_text(5000, 20000, true), Err(JobError::TooLong { .. })));
    }
}
