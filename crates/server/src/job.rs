//! What a request asks of the engine thread and what it hears back: the prompt, the job with
//! its event channel, the limits the server set on the answer, and why a job could not run.

use std::sync::Arc;

use engine::tokenizer::ChatMessage;
use engine::{CancelToken, GenerateRequest, Summary};
use tokio::sync::mpsc as tmpsc;

use crate::tools::CallEvent;

/// What the model is asked.
#[derive(Debug, Clone)]
pub enum Prompt {
    Chat {
        messages: Vec<ChatMessage>,
        template_vars: serde_json::Map<String, serde_json::Value>,
        /// Tools the answer may call that the template's `tools` leave out, in its form:
        /// deferred tools a `tool_reference` loaded (Anthropic's tool search), whose definitions
        /// the messages carry where they were loaded.
        loaded_tools: Vec<serde_json::Value>,
    },
    Text(String),
}

impl Prompt {
    /// Bytes of the text it carries (messages and tool-call arguments), before any template:
    /// what bounds its token count from below.
    pub(crate) fn text_bytes(&self) -> usize {
        match self {
            Prompt::Text(t) => t.len(),
            Prompt::Chat { messages, .. } => messages
                .iter()
                .map(|m| {
                    m.content.len() + m.tool_calls.iter().map(|c| c.function.arguments.to_string().len()).sum::<usize>()
                })
                .sum(),
        }
    }
}

#[derive(Debug)]
pub struct Job {
    /// Only render and count the prompt (answers `Started`, then stops).
    pub count_only: bool,
    pub prompt: Prompt,
    /// The request's sampling, stops and limits; its `prompt` is filled in by the worker.
    pub request: GenerateRequest,
    /// Unbounded: the engine never waits for a slow client (it would stall every request
    /// decoding with it); what piles up is at most one answer's deltas.
    pub events: tmpsc::UnboundedSender<JobEvent>,
    pub cancel: CancelToken,
    /// What the client has taken of the events (a client that stops reading is let go).
    pub backlog: Arc<crate::backlog::Backlog>,
}

#[derive(Debug)]
pub enum JobEvent {
    /// The prompt fit; `max_tokens` is what will be generated at most: the request's, or less
    /// when that did not fit the context left after the prompt or the server's cap.
    Started {
        prompt_tokens: usize,
        max_tokens: usize,
        clamped: Option<Clamp>,
    },
    /// The prefill has begun: how many of the prompt's tokens the prompt cache restored.
    /// Sent once, before the first delta.
    Prefilled {
        cached_tokens: usize,
    },
    Delta {
        content: String,
        reasoning: String,
        /// Tool calls as they are written: begun, arguments in fragments, ended.
        tool_calls: Vec<CallEvent>,
    },
    Finished {
        summary: Summary,
        reasoning_tokens: usize,
    },
    Failed(JobError),
}

/// The `max_tokens` a request gets when its client sent none: the server chooses (what the
/// context, the memory and `--max-output-tokens` leave), not a fixed default.
pub const NOT_ASKED: usize = usize::MAX;

/// A limit on the answer the server set: lowered from what the request asked (`asked`), or
/// chosen where it asked nothing (`None`); and what set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clamp {
    pub asked: Option<usize>,
    pub by: ClampedBy,
}

impl Clamp {
    /// For the log: " (max_tokens 160 of the 32000 asked, set by the server)".
    pub(crate) fn describe(&self, max_tokens: usize) -> String {
        let by = self.by.name();
        match self.asked {
            Some(asked) => format!(" (max_tokens {max_tokens} of the {asked} asked, set by the {by})"),
            None => format!(" (max_tokens {max_tokens}: none asked, set by the {by})"),
        }
    }
}

impl ClampedBy {
    /// How headers and the log name it.
    pub fn name(self) -> &'static str {
        match self {
            ClampedBy::Context => "context",
            ClampedBy::ServerCap => "server",
            ClampedBy::Memory => "memory",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClampedBy {
    /// The model's context, after the prompt.
    Context,
    /// The server's `--max-output-tokens`.
    ServerCap,
    /// The memory left beside the model: the KV cache of a longer answer would not fit.
    Memory,
}

/// Why a job could not run: the client's fault (4xx), a full queue (429), or the server's (5xx).
#[derive(Debug, Clone)]
pub enum JobError {
    BadRequest(String),
    /// The prompt (at least `prompt_tokens`) does not fit the model's `context`.
    TooLong {
        message: String,
        prompt_tokens: usize,
        context: usize,
    },
    Busy(String),
    Internal(String),
    /// The server cannot answer now (a split model's rank is gone): a 503.
    Unavailable(String),
}

impl JobError {
    /// A prompt of `tokens` (`size` says how many, in words) that the model's context cannot hold.
    pub(crate) fn too_long(tokens: usize, size: &str, context: usize) -> Self {
        JobError::TooLong {
            message: format!("the prompt is {size}, and the model's context is {} tokens: it does not fit", context),
            prompt_tokens: tokens,
            context,
        }
    }
}

/// A submitted job whose prompt was accepted: its events, and a guard that cancels it when
/// dropped (the response, or the stream a disconnected client leaves behind).
pub struct Running {
    pub events: tmpsc::UnboundedReceiver<JobEvent>,
    /// Told of each event the client takes.
    pub backlog: Arc<crate::backlog::Backlog>,
    pub prompt_tokens: usize,
    /// The most tokens it will generate, and the request's own number when that was more.
    pub max_tokens: usize,
    pub clamped: Option<Clamp>,
    pub guard: CancelOnDrop,
}

pub struct CancelOnDrop(pub CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// A tuner run on the engine thread (which owns the model): measures, reports progress,
/// stops when `progress` returns `false`.
pub struct TuneJob {
    pub options: engine::tune::TuneOptions,
    pub progress: Box<dyn FnMut(&engine::tune::Progress) -> bool + Send>,
    /// Percent of a core another process may use before the measurement is called busy.
    pub busy_percent: f32,
    pub reply: tokio::sync::oneshot::Sender<Result<engine::tune::Measurement, String>>,
}

/// What the engine thread receives, in order.
pub(crate) enum Message {
    Job(Box<Job>),
    /// Measure draft depths (the app's Tune button).
    Tune(TuneJob),
    /// Drop the model now (it loads again for the next job).
    Unload,
}
