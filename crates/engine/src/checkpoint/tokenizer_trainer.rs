//! A small byte-level BPE tokenizer, trained with the `tokenizers` crate on a built-in
//! corpus, with Qwen's special tokens and a Qwen-style chat template.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};

use crate::error::{Error, Result};

const CORPUS: &str = include_str!("corpus.txt");

/// Special tokens in Qwen's order; `special` ones are dropped when decoding.
pub const SPECIAL_TOKENS: &[(&str, bool)] = &[
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<think>", false),
    ("</think>", false),
    ("<tool_call>", false),
    ("</tool_call>", false),
];

/// A Qwen3-style chat template: ChatML turns, tools in the system turn, tool calls as
/// `<tool_call>` JSON, tool output as `<tool_response>` in a user turn, a thinking switch.
pub const CHAT_TEMPLATE: &str = r##"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content }}
{%- for tool_call in message.tool_calls | default([]) %}
{%- if (loop.first and message.content) or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": ' + (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"##;

/// Trains a tokenizer of at most `max_vocab` entries (special tokens included) on the small
/// built-in corpus and writes `tokenizer.json`. Returns the number of entries.
pub fn write_tokenizer(path: &Path, max_vocab: usize) -> Result<usize> {
    train_tokenizer(path, max_vocab, CORPUS.lines().map(|l| format!("{l}\n")))
}

/// Trains a byte-level BPE tokenizer of at most `max_vocab` entries (the special tokens last,
/// as Qwen orders them) on `texts` and writes it to `path`. Returns the number of entries.
pub fn train_tokenizer<I>(path: &Path, max_vocab: usize, texts: I) -> Result<usize>
where
    I: Iterator<Item = String> + Send,
{
    let err = |e: tokenizers::Error| Error::Tokenizer { path: path.to_path_buf(), message: e.to_string() };
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(max_vocab - SPECIAL_TOKENS.len())
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tokenizer = TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevelDecoder>::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_post_processor(Some(ByteLevel::default().trim_offsets(false)))
        .with_decoder(Some(ByteLevelDecoder::default()))
        .build()
        .map_err(err)?;
    tokenizer.train(&mut trainer, texts).map_err(err)?;
    // In id order: each kind is added in its own call, so keep them grouped as Qwen does.
    for (token, special) in SPECIAL_TOKENS {
        let added = [AddedToken::from(*token, *special)];
        if *special {
            tokenizer.add_special_tokens(&added);
        } else {
            tokenizer.add_tokens(&added);
        }
    }
    tokenizer.save(path, true).map_err(err)?;
    Ok(tokenizer.get_vocab_size(true))
}
