//! How the engine thread runs what it is given: one job alone (render, admit, generate,
//! stream) or several decoding together as a batch.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use engine::batch_rule::BatchRule;
use engine::{CancelToken, Engine, Event};

use crate::admit::Room;
use crate::job::{Clamp, Job, JobError, JobEvent, Message, Prompt};
use crate::metrics::Metrics;
use crate::model_info::ModelInfo;
use crate::scripted::ScriptedReplies;
use crate::think::ThinkSplitter;
use crate::tools::{Parsed, ToolCallParser};

/// The prompt's token ids, its text, and whether it leaves the answer in reasoning mode.
pub(crate) fn render(engine: &Engine, prompt: &Prompt) -> Result<(Vec<u32>, String, bool), JobError> {
    let (ids, text) = match prompt {
        Prompt::Text(t) => (engine.tokenizer().encode(t).map_err(|e| JobError::Internal(e.to_string()))?, t.clone()),
        // A special token's text in a message stays text (`encode_chat`).
        Prompt::Chat { messages, template_vars, .. } => engine
            .tokenizer()
            .encode_chat(messages, true, template_vars)
            .map_err(|e| JobError::BadRequest(e.to_string()))?,
    };
    // Templates that open the think block themselves leave the answer in reasoning mode.
    let thinking = text.trim_end().ends_with("<think>");
    Ok((ids, text, thinking))
}

/// A job whose answer is being generated: where its events go and what they go through.
pub(crate) struct Live<'m> {
    job: Job,
    answer: AnswerStream,
    prompt_tokens: usize,
    max_tokens: usize,
    clamped: Option<Clamp>,
    /// Whether its client has been told what the prompt cache restored.
    told_prefilled: bool,
    /// Its place in the live figures' streams (left when it is dropped).
    stream: StreamShown<'m>,
}

impl Live<'_> {
    /// Tells the client once what the prompt cache restored (known once the prefill began).
    fn tell_prefilled(&mut self, cached_tokens: usize) {
        if !std::mem::replace(&mut self.told_prefilled, true) {
            let _ = self.job.events.send(JobEvent::Prefilled { cached_tokens });
        }
    }
}

/// A request shown as a stream in the live figures while it exists.
struct StreamShown<'m> {
    metrics: &'m Metrics,
    id: u64,
}

impl<'m> StreamShown<'m> {
    fn new(metrics: &'m Metrics) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
        metrics.stream_started(id);
        StreamShown { metrics, id }
    }
}

impl Drop for StreamShown<'_> {
    fn drop(&mut self) {
        self.metrics.stream_ended(self.id);
    }
}

/// How a job run alone ended: done (with the tokens of context it used), or handed to a batch
/// because others came while it ran.
pub(crate) enum Solo<'e> {
    Ended(usize),
    Joins(Box<(Live<'e>, engine::generate::Generation<'e>)>),
}

/// Runs one job alone (speculation as the request asks) until it ends, or until others wait
/// (`waiting` > 0) and it can go on in a batch with them (between its speculative cycles).
pub(crate) fn run_job<'e>(
    engine: &'e Engine,
    info: &ModelInfo,
    rule: &BatchRule,
    metrics: &'e Metrics,
    scripted: Option<&ScriptedReplies>,
    job: Job,
    waiting: &AtomicUsize,
) -> Solo<'e> {
    let (mut live, mut generation) = match start_job(engine, info, metrics, scripted, job, false) {
        Ok(started) => started,
        Err(used) => return Solo::Ended(used),
    };
    metrics.generating.store(true, Ordering::SeqCst);
    let _done = ClearOnDrop(&metrics.generating);
    let _held = ClearOnDrop(&metrics.waiting_for_speculation);
    // Since when others have waited for it (they join it after the profile's hold at most).
    let mut others_since: Option<std::time::Instant> = None;
    let hold = Duration::from_secs_f64(info.profile.speculation_hold_s.max(0.0));
    while let Some(event) = generation.next() {
        metrics.set_depth_control(generation.depth_control());
        live.tell_prefilled(generation.cached_tokens());
        if let Some(used) = on_event(&mut live, engine, metrics, event) {
            return Solo::Ended(used);
        }
        let others = waiting.load(Ordering::SeqCst);
        let since = match others {
            0 => None,
            _ => Some(*others_since.get_or_insert_with(std::time::Instant::now)),
        };
        others_since = since;
        if let Some(since) = since.filter(|_| info.profile.max_sequences > 1 && generation.can_join_batch()) {
            // What speculation gives this request now: its depth controller's live estimate,
            // else the tuned speed-up (the batch's gain is measured against plain decoding).
            let speedup = generation.depth_control().map_or(rule.tuned_speedup, |c| c.expected_speedup);
            let together = (1 + others).min(info.profile.max_sequences);
            if rule.batch_pays(together, speedup) || since.elapsed() >= hold {
                return Solo::Joins(Box::new((live, generation)));
            }
        }
        // (With one sequence at a time they wait for the profile, not for speculation.)
        metrics.waiting_for_speculation.store(since.is_some() && info.profile.max_sequences > 1, Ordering::Relaxed);
    }
    Solo::Ended(live.prompt_tokens)
}

/// Checks a job, renders its prompt and starts its generation (`Started` sent), or says how
/// much context it used when it ends here (refused, counted only, its client gone).
pub(crate) fn start_job<'e>(
    engine: &'e Engine,
    info: &ModelInfo,
    metrics: &'e Metrics,
    scripted: Option<&ScriptedReplies>,
    mut job: Job,
    batched: bool,
) -> Result<(Live<'e>, engine::generate::Generation<'e>), usize> {
    let send = |e: JobEvent| job.events.send(e).is_ok();
    if job.cancel.is_cancelled() || job.events.is_closed() {
        return Err(0);
    }
    // The KV cache of prompt and answer must fit the memory left beside the model too.
    let room = Room {
        context: info.context,
        memory_budget: info.memory_budget,
        held: engine::memory::mlx_memory().active,
        kv_bytes_per_token: info.kv_bytes_per_token,
        cap: info.max_output_tokens,
    };
    // A prompt whose text alone cannot fit is refused before the template renders it.
    let text_bytes = job.prompt.text_bytes();
    let least = engine.tokenizer().at_least_tokens(text_bytes);
    if let Err(e) = room.check_text(least, text_bytes, job.count_only) {
        send(JobEvent::Failed(e));
        return Err(0);
    }
    let (ids, text, thinking) = match render(engine, &job.prompt) {
        Ok(r) => r,
        Err(e) => {
            send(JobEvent::Failed(e));
            return Err(0);
        }
    };
    if ids.is_empty() {
        send(JobEvent::Failed(JobError::BadRequest("the prompt is empty".into())));
        return Err(0);
    }
    // Each image's token stands for as many as its size takes (the engine repeats it).
    let prompt_tokens = ids.len() + engine.image_tokens(&job.request.images);
    if job.count_only {
        send(JobEvent::Started { prompt_tokens, max_tokens: 0, clamped: None });
        return Err(0);
    }
    let (max_tokens, clamped) = match room.answer_budget(prompt_tokens, job.request.max_tokens) {
        Ok(budget) => budget,
        Err(e) => {
            send(JobEvent::Failed(e));
            return Err(0);
        }
    };
    job.request.max_tokens = max_tokens;
    if clamped.is_some_and(|c| c.asked.is_some()) {
        metrics.max_tokens_clamped.fetch_add(1, Ordering::Relaxed);
    }
    job.request.prompt = ids;
    if let Some(reply) = scripted.and_then(|s| s.reply_for(&text)) {
        tracing::info!("a scripted reply answers this prompt (--scripted-replies): {reply:?}");
        match engine.tokenizer().encode(reply) {
            Ok(tokens) => job.request.forced_tokens = Some(tokens),
            Err(e) => {
                send(JobEvent::Failed(JobError::Internal(format!("tokenizing a scripted reply: {e}"))));
                return Err(0);
            }
        }
    }
    if batched {
        // A batch decodes plainly: the MTP head drafts for one sequence at a time.
        job.request.draft_depth = 0;
    }
    let generation = match engine.generate(job.request.clone(), job.cancel.clone()) {
        Ok(g) => g,
        Err(e @ engine::Error::GroupDown(_)) => {
            send(JobEvent::Failed(JobError::Unavailable(e.to_string())));
            return Err(0);
        }
        Err(e) => {
            send(JobEvent::Failed(JobError::BadRequest(e.to_string())));
            return Err(0);
        }
    };
    if !send(JobEvent::Started { prompt_tokens, max_tokens, clamped }) {
        return Err(prompt_tokens);
    }
    // With tools offered, the answer is searched for tool calls.
    let offered = crate::tool_choice::offered(&job.prompt);
    let answer = AnswerStream::new(thinking, (!offered.is_empty()).then_some(offered.as_slice()));
    let stream = StreamShown::new(metrics);
    Ok((Live { job, answer, prompt_tokens, max_tokens, clamped, told_prefilled: false, stream }, generation))
}

/// Passes one event of a live job on to its client; how much context the job used once it
/// ended.
pub(crate) fn on_event(
    live: &mut Live<'_>,
    engine: &Engine,
    metrics: &Metrics,
    event: engine::Result<Event>,
) -> Option<usize> {
    let Live { job, answer, prompt_tokens, max_tokens, clamped, stream, .. } = live;
    let (prompt_tokens, max_tokens, clamped) = (*prompt_tokens, *max_tokens, *clamped);
    let send = |e: JobEvent| job.events.send(e).is_ok();
    match event {
        Ok(Event::Text(t)) => {
            metrics.tokens.fetch_add(1, Ordering::Relaxed);
            metrics.stream_token(stream.id);
            if let Some(e) = answer.push(&t) {
                job.backlog.sent();
                if !send(e) {
                    // The client went away: stop at the next token; the cache goes with the generation.
                    job.cancel.cancel();
                } else if job.backlog.stalled() && !job.cancel.is_cancelled() {
                    tracing::warn!(
                        "a client took nothing of its answer for {:.0} s: its request is cancelled",
                        job.backlog.stall.as_secs_f64()
                    );
                    job.cancel.cancel();
                }
            }
            None
        }
        Ok(Event::Finished(summary)) => {
            if let Some(e) = answer.finish() {
                send(e);
            }
            metrics.record(&summary);
            tracing::info!(
                "{} prompt tokens ({} from the prompt cache; {:.1} s to the first token, {:.0} tok/s), {} generated ({:.1} tok/s), {:?}{}",
                prompt_tokens,
                summary.usage.cached_tokens,
                summary.timings.ttft.as_secs_f64(),
                summary.timings.prompt_tps,
                summary.usage.completion_tokens,
                summary.timings.decode_tps,
                summary.finish_reason,
                clamped.map(|c| c.describe(max_tokens)).unwrap_or_default()
            );
            let reasoning_tokens = if answer.reasoning.is_empty() {
                0
            } else {
                engine.tokenizer().encode(&answer.reasoning).map(|v| v.len()).unwrap_or(0)
            };
            let used = prompt_tokens + summary.usage.completion_tokens;
            send(JobEvent::Finished { summary, reasoning_tokens });
            Some(used)
        }
        Err(e) => {
            send(JobEvent::Failed(JobError::Internal(e.to_string())));
            Some(prompt_tokens)
        }
    }
}

/// Where a batch finds newcomers: the engine's channel, the count of jobs waiting in it, and
/// the messages other than jobs that came while the batch ran (they wait until it is over).
pub(crate) struct Queue<'q> {
    pub(crate) rx: &'q mpsc::Receiver<Message>,
    pub(crate) waiting: &'q AtomicUsize,
    pub(crate) deferred: &'q mut std::collections::VecDeque<Message>,
}

/// Runs `first` and the jobs that arrive while it runs decoded together
/// (`engine::batch::Batch`: one forward pass a step for all): a job joins between steps, its
/// prompt prefilled a chunk per step, and leaves when it ends, the others untouched. At most
/// the profile's `max_sequences` run at once, and their KV caches may reserve (prompt and
/// longest answer each) at most its `batch_memory_share` of the memory left beside the model;
/// the next job waits, first in line, until one ends.
pub(crate) fn run_batch<'e>(
    engine: &'e Engine,
    info: &ModelInfo,
    metrics: &'e Metrics,
    scripted: Option<&ScriptedReplies>,
    first: (Live<'e>, engine::generate::Generation<'e>),
    queue: Queue<'_>,
    running: &std::sync::Mutex<Vec<CancelToken>>,
) {
    let Queue { rx, waiting, deferred } = queue;
    let max = info.profile.max_sequences.max(1);
    let mut batch: engine::batch::Batch<'e, usize> = Default::default();
    let mut live: std::collections::HashMap<usize, Live<'e>> = Default::default();
    let mut next_id = 0;
    let mut add = |mut l: Live<'e>,
                   generation: engine::generate::Generation<'e>,
                   batch: &mut engine::batch::Batch<'e, usize>,
                   live: &mut std::collections::HashMap<usize, Live<'e>>| {
        next_id += 1;
        match batch.queue(next_id, generation) {
            Ok(()) => {
                l.tell_prefilled(batch.cached_tokens(&next_id).unwrap_or(0));
                if let Ok(mut r) = running.lock() {
                    r.push(l.job.cancel.clone());
                }
                live.insert(next_id, l);
            }
            Err(e) => {
                let _ = l.job.events.send(JobEvent::Failed(JobError::Internal(e.to_string())));
            }
        }
    };
    if let Ok(mut r) = running.lock() {
        r.clear();
    }
    let (first_live, first_generation) = first;
    add(first_live, first_generation, &mut batch, &mut live);
    // Tokens of KV cache the memory beside the model holds with nothing running.
    let room = engine::memory::kv_room_tokens(info.memory_budget, info.kv_bytes_per_token) + batch.kv_tokens().0;
    let share = (room as f64 * info.profile.batch_memory_share) as usize;
    // The next job when it waits for memory (still counted as waiting).
    let mut next: Option<Job> = None;
    metrics.generating.store(true, Ordering::SeqCst);
    let _done = ClearOnDrop(&metrics.generating);
    loop {
        while batch.len() < max && (next.is_some() || deferred.is_empty()) {
            let job = match next.take() {
                Some(job) => job,
                None => match rx.try_recv() {
                    Ok(Message::Job(job)) => *job,
                    Ok(other) => {
                        deferred.push_back(other);
                        break;
                    }
                    Err(_) => break,
                },
            };
            if !batch.is_empty() && batch.kv_tokens_with(kv_tokens_asked(engine, info, &job)) > share {
                next = Some(job);
                break;
            }
            waiting.fetch_sub(1, Ordering::SeqCst);
            // Cleared before the job starts: its client hears of its prefill inside `add`, and
            // may ask the status right then.
            metrics.waiting_for_memory.store(false, Ordering::Relaxed);
            match start_job(engine, info, metrics, scripted, job, true) {
                Ok((l, generation)) => add(l, generation, &mut batch, &mut live),
                Err(used) => engine.after_request(used),
            }
        }
        metrics.waiting_for_memory.store(next.is_some(), Ordering::Relaxed);
        if batch.is_empty() {
            break;
        }
        metrics.batch_size.store(batch.len(), Ordering::Relaxed);
        metrics.prefilling.store(batch.prefilling().0, Ordering::Relaxed);
        for (id, event) in batch.step() {
            let Some(l) = live.get_mut(&id) else { continue };
            if let Some(used) = on_event(l, engine, metrics, event) {
                if let Some(done) = live.remove(&id) {
                    if let Ok(mut r) = running.lock() {
                        r.retain(|c| !c.same_as(&done.job.cancel));
                    }
                }
                engine.after_request(used);
            }
        }
    }
    metrics.batch_size.store(0, Ordering::Relaxed);
    metrics.prefilling.store(0, Ordering::Relaxed);
}

/// The most tokens of KV cache `job` may take, as far as can be told before its prompt is
/// rendered: its prompt's least token count and the answer it asks (within the context and the
/// server's cap).
pub(crate) fn kv_tokens_asked(engine: &Engine, info: &ModelInfo, job: &Job) -> usize {
    let prompt = engine.tokenizer().at_least_tokens(job.prompt.text_bytes());
    let answer = job.request.max_tokens.min(info.max_output_tokens.unwrap_or(usize::MAX));
    prompt.saturating_add(answer).min(info.context)
}

/// Clears a flag when dropped (however the job ends).
pub(crate) struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Turns the model's text into answer deltas: reasoning split off, tool calls parsed out
/// (when tools were offered); keeps the reasoning to count its tokens at the end.
struct AnswerStream {
    splitter: ThinkSplitter,
    tools: Option<ToolCallParser>,
    reasoning: String,
}

impl AnswerStream {
    /// `tools`: the tools the prompt offered, if any (their answers are searched for calls).
    fn new(thinking: bool, tools: Option<&[serde_json::Value]>) -> Self {
        AnswerStream {
            splitter: ThinkSplitter::new(thinking),
            tools: tools.map(ToolCallParser::for_tools),
            reasoning: String::new(),
        }
    }

    /// The delta for more text, if it adds anything.
    fn push(&mut self, text: &str) -> Option<JobEvent> {
        let s = self.splitter.push(text);
        self.delta(s.content, s.reasoning, false)
    }

    /// The rest at the end of the answer.
    fn finish(&mut self) -> Option<JobEvent> {
        let s = self.splitter.finish();
        self.delta(s.content, s.reasoning, true)
    }

    fn delta(&mut self, content: String, reasoning: String, last: bool) -> Option<JobEvent> {
        self.reasoning.push_str(&reasoning);
        let Parsed { text: mut content, calls: mut tool_calls } = match &mut self.tools {
            Some(p) => p.push(&content),
            None => Parsed { text: content, calls: vec![] },
        };
        if let (true, Some(p)) = (last, &mut self.tools) {
            let rest = p.finish();
            content.push_str(&rest.text);
            tool_calls.extend(rest.calls);
        }
        let empty = content.is_empty() && reasoning.is_empty() && tool_calls.is_empty();
        (!empty).then_some(JobEvent::Delta { content, reasoning, tool_calls })
    }
}
