#!/usr/bin/env python3
"""Regenerates the seed corpora in fuzz/corpus/<target>/ from the repository and ../shared.

Run from the repository root: python3 fuzz/make_seeds.py. Needs protoc (protobuf-compiler). The seeds are
small, real inputs: the shared models' config.json files, the cluster files, a safetensors image rebuilt from
the first tensors of a shared checkpoint's header with the shapes shrunk, a SentencePiece model cut down from
the shared tokenizer.model, and text-format requests encoded with protoc.
"""
import json
import os
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def out(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def encode(message, proto, text):
    return subprocess.run(["protoc", f"--encode={message}", "-I", os.path.join(ROOT, "proto"), proto],
                          input=text.encode(), capture_output=True, check=True).stdout


def safetensors_image(header, data_len, fill=0x3C):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header with spaces to 8 bytes
    return struct.pack("<Q", len(text)) + text + bytes([fill]) * data_len


def safetensors_seeds():
    path = os.path.join(SHARED, "models", "mixtral-tiny", "model.safetensors")
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        real = json.loads(f.read(n))
    # The first five tensors of the real header, in data order, shrunk to at most 4 x 8 elements.
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1}
    header = {"__metadata__": real.get("__metadata__", {"format": "pt"})}
    offset = 0
    entries = sorted(((k, v) for k, v in real.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
    for name, v in entries[:5]:
        shape = [min(d, 8 if i else 4) for i, d in enumerate(v["shape"])]
        nbytes = sizes[v["dtype"]]
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": v["dtype"], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    out("safetensors_fuzzer", "mixtral_tiny_shrunk.safetensors", safetensors_image(header, offset))
    out("safetensors_fuzzer", "empty.safetensors", safetensors_image({}, 0))
    mixed = {
        "__metadata__": {"format": "pt", "note": "dtypes"},
        "scalar": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        "empty": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [4, 4]},
        "ids": {"dtype": "I64", "shape": [2], "data_offsets": [4, 20]},
        "bits": {"dtype": "F4", "shape": [3], "data_offsets": [20, 22]},
        "fp8": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [22, 26]},
    }
    out("safetensors_fuzzer", "dtypes.safetensors", safetensors_image(mixed, 26))


def config_seeds():
    models = os.path.join(SHARED, "models")
    for m in sorted(os.listdir(models)):
        p = os.path.join(models, m, "config.json")
        if os.path.exists(p):
            with open(p, "rb") as f:
                out("model_config_fuzzer", f"{m}.json", f.read())
    for m in sorted(os.listdir(os.path.join(ROOT, "configs", "models"))):
        p = os.path.join(ROOT, "configs", "models", m, "config.json")
        if os.path.exists(p):
            with open(p, "rb") as f:
                out("model_config_fuzzer", f"configs_{m}.json", f.read())


def cluster_seeds():
    with open(os.path.join(ROOT, "configs", "local.toml"), "rb") as f:
        out("cluster_config_fuzzer", "local.toml", f.read())
    out("cluster_config_fuzzer", "minimal.toml", """[model]
path = "m"
[[node]]
name = "main"
role = "main"
address = "127.0.0.1:7100"
[[node]]
name = "w0"
role = "worker"
address = "127.0.0.1:7110"
""")
    out("cluster_config_fuzzer", "full.toml", """[cluster]
name = "two-groups"
epoch = 3
group_size = 2
rpc_timeout_ms = 500
startup_timeout_ms = 1000
[model]
path = "/abs/model"
[[node]]
name = "main"
role = "main"
address = "[::1]:7100"
device = "cuda"
threads = 4
[[node]]
name = "shadow"
role = "shadow"
address = "localhost:7101"
[[node]]
name = "w0"
role = "worker"
address = "10.0.0.1:7110"
device = "mock-gpu"
gpu_budget_mb = 64
[[node]]
name = "w1"
role = "worker"
address = "10.0.0.2:7110"
device = "mock-gpu"
gpu_budget_mb = 64
""")


def tokenizer_seeds():
    proto = "odmoe/spm/sentencepiece_model.proto"
    src = os.path.join(SHARED, "models", "demo-mixtral-kjv", "tokenizer.model")
    text = subprocess.run(["protoc", "--decode=odmoe.spm.ModelProto", "-I", os.path.join(ROOT, "proto"), proto],
                          stdin=open(src, "rb"), capture_output=True, check=True).stdout.decode()
    pieces = text.split("trainer_spec {")[0].split("pieces {")[1:]
    # <unk>, <s>, </s>, the 256 byte pieces and the 96 best merges: a byte-fallback BPE model of 355 pieces.
    kept = pieces[:3 + 256 + 96]
    def model(kept_pieces, byte_fallback, dummy_prefix, extra_ws):
        return "".join("pieces {" + p for p in kept_pieces) + f"""trainer_spec {{
  model_type: BPE
  vocab_size: {len(kept_pieces)}
  byte_fallback: {str(byte_fallback).lower()}
  unk_id: 0
  bos_id: 1
  eos_id: 2
  pad_id: -1
}}
normalizer_spec {{
  name: "identity"
  add_dummy_prefix: {str(dummy_prefix).lower()}
  remove_extra_whitespaces: {str(extra_ws).lower()}
}}
"""
    out("tokenizer_fuzzer", "kjv_small.model", encode("odmoe.spm.ModelProto", proto, model(kept, True, True, False)))
    no_bytes = pieces[:3] + pieces[3 + 256:3 + 256 + 60]
    out("tokenizer_fuzzer", "kjv_no_byte_fallback.model",
        encode("odmoe.spm.ModelProto", proto, model(no_bytes, False, False, True)))


def rpc_seeds():
    proto = "odmoe/v1/common.proto"
    f32 = lambda vals: "".join("\\%03o" % b for v in vals for b in struct.pack("<f", v))
    out("rpc_tensor_fuzzer", "f32_2x4.pb",
        encode("odmoe.v1.Tensor", proto, f'dtype: DTYPE_F32 shape: 2 shape: 4 data: "{f32(range(8))}"'))
    out("rpc_tensor_fuzzer", "f32_2x2x3.pb",
        encode("odmoe.v1.Tensor", proto, f'dtype: DTYPE_F32 shape: 2 shape: 2 shape: 3 data: "{f32(range(12))}"'))
    out("rpc_tensor_fuzzer", "bf16_1x2.pb", encode("odmoe.v1.Tensor", proto, 'dtype: DTYPE_BF16 shape: 1 shape: 2 data: "\\000\\077\\000\\100"'))
    out("rpc_tensor_fuzzer", "f32_wrong_size.pb",
        encode("odmoe.v1.Tensor", proto, f'dtype: DTYPE_F32 shape: 3 data: "{f32([1, 2])}"'))


def request_seeds():
    f32 = lambda n: "".join("\\%03o" % b for i in range(n) for b in struct.pack("<f", (i % 7) * 0.25 - 0.5))
    hidden = 128  # mixtral-tiny
    proto = "odmoe/v1/worker.proto"
    for name, layer, rows, tasks in [
        ("one_expert", 0, 1, "tasks { expert: 3 rows: 0 }"),
        ("two_experts", 1, 3, "tasks { expert: 0 rows: 0 rows: 2 } tasks { expert: 7 rows: 1 }"),
        ("bad_rows", 2, 2, "tasks { expert: 1 rows: 1 rows: 0 }"),
        ("wrong_epoch", 0, 1, "tasks { expert: 1 rows: 0 }"),
    ]:
        header = 'header { epoch: 99 model_fingerprint: "other" sender: "main" }' if name == "wrong_epoch" else \
            'header { sender: "main" request_id: 1 }'
        text = f'{header} layer: {layer} hidden {{ dtype: DTYPE_F32 shape: {rows} shape: {hidden} ' \
               f'data: "{f32(rows * hidden)}" }} {tasks}'
        out("worker_request_fuzzer", f"{name}.pb", encode("odmoe.v1.ComputeExpertsRequest", proto, text))
    for name, text in [
        ("two_experts", 'header { sender: "main" } layer: 1 experts: 2 experts: 5'),
        ("all_experts", 'header { sender: "main" } layer: 0 ' + " ".join(f"experts: {e}" for e in range(8))),
        ("twice", 'header { sender: "main" } layer: 2 experts: 3 experts: 3'),
    ]:
        out("prefetch_request_fuzzer", f"{name}.pb", encode("odmoe.v1.PrefetchRequest", proto, text))
    proto = "odmoe/v1/main.proto"
    for name, text in [
        ("text_prompt", 'prompt: "In the beginning God created" max_new_tokens: 4'),
        ("ids_sampled", "prompt_ids: 1 prompt_ids: 400 prompt_ids: 33 max_new_tokens: 2 "
                        "sampling { temperature: 0.8 top_k: 40 top_p: 0.9 seed: 7 min_p: 0.05 repetition_penalty: 1.1 }"
                        " dump_logits: true dump_routing: true"),
        ("both_prompts", 'prompt: "x" prompt_ids: 5 max_new_tokens: 1'),
        ("out_of_vocab", "prompt_ids: 4096 max_new_tokens: 1"),
    ]:
        out("generate_request_fuzzer", f"{name}.pb", encode("odmoe.v1.GenerateRequest", proto, text))
    # The shadow's Follow stream (mixtral-tiny: 3 layers, 2 kv heads x 32): a start, a step with token and K/V,
    # the prompt's K/V, and malformed ones.
    proto = "odmoe/v1/shadow.proto"
    kv = 3 * 2 * 32
    for name, text in [
        ("start", 'start { header { sender: "main" request_id: 3 } prompt_ids: 1 prompt_ids: 40 prompt_ids: 7 '
                  "max_new_tokens: 8 align_token: 1 align_kv: 1 max_lead_tokens: 1 }"),
        ("step_token_kv", f'step {{ position: 3 has_token: true token: 42 k {{ dtype: DTYPE_F32 shape: 3 shape: 64 '
                          f'data: "{f32(kv)}" }} v {{ dtype: DTYPE_F32 shape: 3 shape: 64 data: "{f32(kv)}" }} }}'),
        ("step_position_only", "step { position: 5 }"),
        ("prompt_kv", f'kv {{ first_position: 0 k {{ dtype: DTYPE_F32 shape: 2 shape: 3 shape: 64 data: "{f32(2 * kv)}" }} '
                      f'v {{ dtype: DTYPE_F32 shape: 2 shape: 3 shape: 64 data: "{f32(2 * kv)}" }} }}'),
        ("bad_token", "step { position: 4 has_token: true token: -1 }"),
    ]:
        out("follow_message_fuzzer", f"{name}.pb", encode("odmoe.v1.FollowMessage", proto, text))


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": -5, "exclusiveMaximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", 1, None, {"k": [True]}]}, "maxItems": 3},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        "extra": {"type": "object", "additionalProperties": {"type": ["number", "boolean"]}},
        "any": {},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def schema_seeds():
    # A schema, a NUL byte, then a text to read with its grammar.
    for name, schema, text in [
        ("person", PERSON_SCHEMA, '{"name": "Ann \\u00e9\xc3\xa9", "age": 42, "tags": ["a", {"k":[true]}], '
                                  '"next": {"name": "B", "age": -5, "next": null}, "extra": {"x": 1.5e3}, "any": [{}]}'),
        ("choice_like", {"enum": ["yes", "no", 12, 1.5]}, "12"),
        ("defs", {"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}, "minItems": 0}},
                  "$ref": "#/$defs/t"}, "[[], [[]], [[[]]]]"),
        ("refused", {"type": "string", "pattern": "a+"}, '"a"'),
        ("json_object", True, '\n  {"a": [1, -0.5e+3, "\xe2\x82\xac"]}'),
        ("surrogates", {"type": "string", "maxLength": 2}, '"\\ud83d\\ude00\\ud800"'),
        ("object_union", {"$defs": {"e": {"oneOf": [
            {"properties": {"op": {"enum": ["+", "*"]}, "args": {"type": "array", "items": {"$ref": "#/$defs/e"}}},
             "required": ["op", "args"]},
            {"properties": {"op": {"const": "neg"}, "arg": {"$ref": "#/$defs/e"}}, "required": ["op", "arg"]},
            {"properties": {"num": {"type": "integer"}}, "required": ["num"]}, {"type": "null"}]}},
            "$ref": "#/$defs/e"}, '{"op": "+", "args": [{"num": 1}, {"op": "neg", "arg": null}]}'),
        ("number_bounds", {"type": "array", "items": {"type": "number", "exclusiveMinimum": -0.5, "maximum": 1e3}},
         "[-0.49, 0, 999.999999, 1000, 12.5]"),
        ("pattern", {"type": "object", "properties": {
            "date": {"pattern": "^\\d{4}-(0[1-9]|1[0-2])-(?:0[1-9]|[12]\\d|3[01])$"},
            "q": {"type": "string", "pattern": "\"[^\"\\\\]*\"|\u00e9{2,}|[\\w.-]+@[a-z]+\\.com"}}},
         '{"date": "2024-02-29", "q": "x \\"hi\\" \\u00e9"}'),
        ("tuple", {"type": "array", "prefixItems": [{"type": "number"}, {"enum": ["N", "S"]}], "items": {"type": "integer"},
                   "maxItems": 4}, '[1.5, "N", 2, -3]'),
        ("unique", {"type": "array", "items": {"enum": ["a", "ab", True, None]}, "uniqueItems": True},
         '["ab", null, "a", true]'),
        ("formats", {"type": "array", "items": {"type": "string", "format": "date-time"}},
         '["2024-02-28T23:59:59.5+05:30", "1999-12-31T00:00:00Z"]'),
    ]:
        out("json_schema_fuzzer", f"{name}.bin", json.dumps(schema).encode() + b"\0" + text.encode("latin-1"))
    # Regular expressions (the fuzzer reads every input's first part as one too), with a text each matches whole.
    for name, regex, text in [
        ("regex_phone", "(?P<area>\\d{3})-\\d{4}( ext\\.? ?\\d{1,5})?", "555-0123 ext. 42"),
        ("regex_lines", "([A-Z][a-z]*( [a-z]+)*[.!?]\n){1,3}[^\\x00-\\x1f]*", "Go forth.\nAnd lo!\n\u00e9\u20ac"),
    ]:
        out("json_schema_fuzzer", f"{name}.bin", regex.encode() + b"\0" + text.encode())


def openai_seeds():
    # The first byte picks the endpoint: "0" /v1/completions, "1" /v1/chat/completions; the rest is the body.
    for name, endpoint, body in [
        ("completion_text", "0", {"model": "tiny-mixtral-kjv", "prompt": "And God said", "max_tokens": 8,
                                  "temperature": 0}),
        ("completion_ids_stream", "0", {"model": "m", "prompt": [[1, 415, 2043], [1, 7]], "stream": True,
                                        "stream_options": {"include_usage": True}, "seed": 5, "top_p": 0.9,
                                        "stop": ["\n", "And"], "ignore_eos": True}),
        ("completion_defaults", "0", {"model": "m", "prompt": ["a", "b"], "n": 1, "logprobs": None, "echo": False,
                                      "presence_penalty": 0, "user": "x"}),
        ("completion_refused", "0", {"model": "m", "prompt": "x", "n": 2, "logit_bias": {"1": 3}}),
        ("completion_vllm_sampling", "0", {"model": "m", "prompt": "x", "temperature": 0.8, "top_k": 20,
                                           "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2}),
        ("chat", "1", {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Who?"},
                                                  {"role": "assistant", "content": "Moses."},
                                                  {"role": "user", "content": [{"type": "text", "text": "When?"}]}],
                       "max_completion_tokens": 16, "temperature": 0.7, "stream": True}),
        ("chat_tools", "1", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                             "tools": [{"type": "function", "function": {"name": "f"}}]}),
        ("chat_tools_required", "1", {
            "model": "m", "tool_choice": "required",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "<tool_call>{\"name\": \"f\", "
                                                                           "\"arguments\": {}}</tool_call>"}],
            "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                        "parameters": PERSON_SCHEMA}},
                      {"type": "function", "function": {"name": "g"}}]}),
        ("chat_tools_named", "1", {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                                   "tool_choice": {"type": "function", "function": {"name": "f"}},
                                   "tools": [{"type": "function", "function": {"name": "f",
                                                                               "parameters": PERSON_SCHEMA}}]}),
        ("chat_json_schema", "1", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                   "response_format": {"type": "json_schema", "json_schema": {
                                       "name": "p", "strict": True, "schema": PERSON_SCHEMA}}}),
        ("completion_guided_json", "0", {"model": "m", "prompt": "x", "guided_json": json.dumps(PERSON_SCHEMA),
                                         "structured_outputs": {"disable_any_whitespace": True}}),
        ("completion_guided_regex", "0", {"model": "m", "prompt": "x", "guided_regex": "(yes|no)[.!]?"}),
        ("chat_structured_regex", "1", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                        "structured_outputs": {"regex": "\\d{4}-\\d{2}-\\d{2}"}}),
    ]:
        out("openai_request_fuzzer", f"{name}.json", endpoint + json.dumps(body))
    out("openai_request_fuzzer", "malformed.json", '0{"model": "m", "prompt": ')


if __name__ == "__main__":
    safetensors_seeds()
    config_seeds()
    cluster_seeds()
    tokenizer_seeds()
    rpc_seeds()
    request_seeds()
    openai_seeds()
    schema_seeds()
    print("seeds written under", CORPUS, file=sys.stderr)
