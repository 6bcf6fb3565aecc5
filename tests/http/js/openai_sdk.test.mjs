// odmoe's OpenAI-compatible HTTP API through the official `openai` JavaScript SDK (the version pinned in
// package-lock.json, maxRetries: 0): a loopback cluster (`odmoe cluster up`: main with http_address and two
// workers) serving ../shared/models/tiny-mixtral-kjv; a completion, a chat, streaming (the streamed text equals
// the whole answer for the same seed), JSON mode, a JSON Schema read back by beta.chat.completions.parse, vLLM's
// guided_regex passed through the SDK as an extra field, the model list, and a 400 and a 404 surfaced as the SDK's
// BadRequestError and NotFoundError. Then tool calling, on a second cluster serving qwen3moe-tiny with a tokenizer of
// byte tokens and a ChatML template that knows tools: the SDK reads the calls of a named function and of "required",
// its stream helper joins the streamed calls into the whole answer's, and a conversation goes on with a call and its
// result. Run by tests/http/run_js_tests.sh (ctest http_openai_sdk), which sets ODMOE_BINARY_DIR and
// ODMOE_SHARED_DIR.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import OpenAI from 'openai';

const MODEL = 'tiny-mixtral-kjv';
const binaryDir = process.env.ODMOE_BINARY_DIR ?? path.resolve('build');
const sharedModels = path.join(process.env.ODMOE_SHARED_DIR ?? path.resolve('../shared'), 'models');
const modelDir = path.join(sharedModels, MODEL);
const odmoe = path.join(binaryDir, 'bin', 'odmoe');
const haveModel = fs.existsSync(path.join(modelDir, 'config.json'));
const qwenDir = path.join(sharedModels, 'qwen3moe-tiny');
const haveQwen = fs.existsSync(path.join(qwenDir, 'config.json'));

// A TCP port on 127.0.0.1 that was free a moment ago, drawn below the kernel's ephemeral range (as
// tests/test_support.h's PickFreePorts): a port 0 listen, or another test's outgoing connection, hands out ports
// from that range, which another process may take before our cluster binds it.
function tryListen(port) {
  return new Promise((resolve) => {
    const server = net.createServer();
    server.once('error', () => resolve(false));
    server.listen(port, '127.0.0.1', () => server.close(() => resolve(true)));
  });
}
const taken = new Set();
async function freePort() {
  let low = 32768;
  try {
    low = Number(fs.readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]) || low;
  } catch {}
  for (let tries = 0; tries < 10000; ++tries) {
    const port = 10000 + Math.floor(Math.random() * (low - 10000));
    if (!taken.has(port) && (await tryListen(port))) {
      taken.add(port);
      return port;
    }
  }
  throw new Error('no free port below the ephemeral range');
}

// A loopback cluster (main with http_address and two workers) serving `model` from a new folder under `dir`:
// `cluster up`, and an SDK client of its API; `down()` stops it.
async function startCluster(dir, model) {
  const [main, w0, w1, http] = [await freePort(), await freePort(), await freePort(), await freePort()];
  const config = path.join(dir, 'cluster.toml');
  fs.writeFileSync(config, [
    '[cluster]', 'name = "http-js"', 'group_size = 2', 'rpc_timeout_ms = 20000', 'startup_timeout_ms = 60000',
    '[model]', `path = "${model}"`, '[shadow]', 'mode = "none"',
    '[[node]]', 'name = "main"', 'role = "main"', `address = "127.0.0.1:${main}"`, 'device = "cpu"',
    `http_address = "127.0.0.1:${http}"`,
    '[[node]]', 'name = "w0"', 'role = "worker"', `address = "127.0.0.1:${w0}"`, 'device = "mock-gpu"',
    '[[node]]', 'name = "w1"', 'role = "worker"', `address = "127.0.0.1:${w1}"`, 'device = "mock-gpu"', '',
  ].join('\n'));
  const run = path.join(dir, 'run');
  const up = execFileSync(odmoe, ['cluster', 'up', '--config', config, '--run-dir', run], { encoding: 'utf8' });
  assert.match(up, new RegExp(`\\nhttp: 127\\.0\\.0\\.1:${http}\\n`));
  return {
    client: new OpenAI({ baseURL: `http://127.0.0.1:${http}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60000 }),
    down: () => execFileSync(odmoe, ['cluster', 'down', '--config', config, '--run-dir', run]),
  };
}

describe(`the OpenAI SDK against a cluster serving ${MODEL}`, { skip: haveModel ? false : `${modelDir} is missing` }, () => {
  let dir;
  let cluster;
  let client;

  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'odmoe-http-js-'));
    cluster = await startCluster(dir, modelDir);
    client = cluster.client;
  });

  after(() => {
    if (cluster) cluster.down();
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  test('lists the model', async () => {
    const models = await client.models.list();
    assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  });

  test('completion', async () => {
    const c = await client.completions.create({ model: MODEL, prompt: 'And God said', max_tokens: 8, temperature: 0 });
    assert.equal(c.object, 'text_completion');
    assert.equal(c.choices.length, 1);
    assert.equal(typeof c.choices[0].text, 'string');
    assert.ok(c.choices[0].text.length > 0);
    assert.ok(['stop', 'length'].includes(c.choices[0].finish_reason));
    assert.ok(c.usage.prompt_tokens > 0);
    assert.ok(c.usage.completion_tokens > 0 && c.usage.completion_tokens <= 8);
    assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + c.usage.completion_tokens);
  });

  test('chat', async () => {
    const c = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'system', content: 'Answer from the Bible.' }, { role: 'user', content: 'Who made light?' }],
      max_tokens: 8,
      temperature: 0,
    });
    assert.equal(c.object, 'chat.completion');
    assert.equal(c.choices[0].message.role, 'assistant');
    assert.equal(typeof c.choices[0].message.content, 'string');
    assert.ok(['stop', 'length'].includes(c.choices[0].finish_reason));
  });

  test('streamed completion equals the whole one for the same seed', async () => {
    const params = { model: MODEL, prompt: 'In the beginning', max_tokens: 20, temperature: 0.8, seed: 5 };
    const whole = await client.completions.create(params);
    const stream = await client.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
    let text = '';
    let finish = null;
    let usage = null;
    let chunks = 0;
    for await (const chunk of stream) {
      chunks += 1;
      for (const choice of chunk.choices) {
        text += choice.text;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
    }
    assert.ok(chunks > 2, `${chunks} chunks`);
    assert.equal(text, whole.choices[0].text);
    assert.equal(finish, whole.choices[0].finish_reason);
    assert.deepEqual(usage, whole.usage);
  });

  test('streamed chat equals the whole one for the same seed', async () => {
    const params = {
      model: MODEL, messages: [{ role: 'user', content: 'Tell of Noah.' }], max_tokens: 16, temperature: 0.7, seed: 9,
    };
    const whole = await client.chat.completions.create(params);
    const stream = await client.chat.completions.create({ ...params, stream: true });
    let text = '';
    let role = null;
    for await (const chunk of stream) {
      const delta = chunk.choices[0]?.delta ?? {};
      if (delta.role) role = delta.role;
      text += delta.content ?? '';
    }
    assert.equal(role, 'assistant');
    assert.equal(text, whole.choices[0].message.content);
  });

  test("chat logprobs: the SDK's stream helper assembles the streamed ones into the whole answer's", async () => {
    const params = {
      model: MODEL, messages: [{ role: 'user', content: 'Who made light?' }], max_tokens: 8, temperature: 0,
      logprobs: true, top_logprobs: 3,
    };
    const whole = await client.chat.completions.create(params);
    const content = whole.choices[0].logprobs.content;
    assert.equal(content.length, whole.usage.completion_tokens);
    for (const t of content) {
      assert.equal(typeof t.token, 'string');
      assert.ok(t.logprob <= 0, String(t.logprob));
      assert.ok(Array.isArray(t.bytes));
      assert.equal(t.top_logprobs.length, 3);
      assert.equal(t.top_logprobs[0].logprob, t.logprob, 'greedy picks the likeliest');
    }
    const streamed = await client.beta.chat.completions.stream(params).finalChatCompletion();
    assert.deepEqual(streamed.choices[0].logprobs.content, content);
  });

  test("n choices: the SDK's stream helper assembles the interleaved chunks into the whole answer's", async () => {
    const params = {
      model: MODEL, messages: [{ role: 'user', content: 'Tell of Noah.' }], max_tokens: 10, temperature: 0.9, seed: 3,
      n: 3,
    };
    const whole = await client.chat.completions.create(params);
    assert.equal(whole.choices.length, 3);
    assert.deepEqual(whole.choices.map((c) => c.index), [0, 1, 2]);
    const streamed = await client.beta.chat.completions.stream(params).finalChatCompletion();
    assert.equal(streamed.choices.length, 3);
    for (let i = 0; i < 3; i += 1) {
      assert.equal(streamed.choices[i].index, i);
      assert.equal(streamed.choices[i].message.content, whole.choices[i].message.content, `choice ${i}`);
      assert.equal(streamed.choices[i].finish_reason, whole.choices[i].finish_reason, `choice ${i}`);
    }
  });

  test("response_format json_object: the answer is one JSON object, closed at once with '}' pushed up", async () => {
    // The id of the token '}' (the last of its ids: SentencePiece puts a bare space before it).
    const tokenized = await (await fetch(new URL('/tokenize', client.baseURL), {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ prompt: '}', add_special_tokens: false }),
    })).json();
    const close = tokenized.tokens.at(-1);
    const params = {
      model: MODEL, messages: [{ role: 'user', content: 'The ark, as JSON.' }], max_tokens: 48, temperature: 0,
      response_format: { type: 'json_object' },
    };
    const closed = await client.chat.completions.create({ ...params, logit_bias: { [close]: 100 } });
    assert.equal(closed.choices[0].finish_reason, 'stop');
    assert.deepEqual(JSON.parse(closed.choices[0].message.content), {});
    const free = await client.chat.completions.create({ ...params, temperature: 0.8, seed: 2 });
    const text = free.choices[0].message.content;
    assert.match(text, /^\s*\{/);
    if (free.choices[0].finish_reason === 'stop') assert.equal(typeof JSON.parse(text), 'object', text);
  });

  test('response_format json_schema: beta.chat.completions.parse reads the answer as an object of the schema',
    async () => {
      const cities = ['Jerusalem', 'Babylon', 'Egypt'];
      const schema = {
        type: 'object',
        properties: {
          name: { type: 'string', maxLength: 20 },
          age: { type: 'integer', minimum: 0, maximum: 120 },
          city: { enum: cities },
        },
        required: ['name', 'age', 'city'],
        additionalProperties: false,
      };
      for (const temperature of [0, 1]) {
        const completion = await client.beta.chat.completions.parse({
          model: MODEL, messages: [{ role: 'user', content: 'A man of the ark, as JSON.' }], max_tokens: 400,
          temperature, seed: 4, response_format: { type: 'json_schema', json_schema: { name: 'person', strict: true, schema } },
        });
        const choice = completion.choices[0];
        assert.equal(choice.finish_reason, 'stop', choice.message.content);
        const person = choice.message.parsed;
        assert.deepEqual(Object.keys(person), ['name', 'age', 'city'], choice.message.content);
        assert.ok(Number.isInteger(person.age) && person.age >= 0 && person.age <= 120, choice.message.content);
        assert.ok(cities.includes(person.city), choice.message.content);
        assert.ok([...person.name].length <= 20, choice.message.content);
      }
      const unsupported = { type: 'object', properties: { code: { type: 'string', pattern: '^(?![A-Z]+$)' } } };
      await assert.rejects(client.chat.completions.create({
        model: MODEL, messages: [{ role: 'user', content: 'x' }],
        response_format: { type: 'json_schema', json_schema: { name: 'code', schema: unsupported } },
      }), (err) => {
        assert.ok(err instanceof OpenAI.BadRequestError, String(err));
        assert.equal(err.param, 'response_format');
        assert.match(err.message, /at '\/properties\/code': 'pattern' at character 3: lookarounds are not supported/);
        return true;
      });
    });

  test('guided_regex, an extra field the SDK sends as it is: the whole answer matches the expression', async () => {
    const regex = '(?P<who>[A-Z][a-z]{1,8}) (said|spake) unto [A-Z][a-z]{1,8}\\.';
    const whole = /^[A-Z][a-z]{1,8} (said|spake) unto [A-Z][a-z]{1,8}\.$/;
    for (const temperature of [0, 1]) {
      const completion = await client.chat.completions.create({
        model: MODEL, messages: [{ role: 'user', content: 'Who spoke?' }], max_tokens: 64, temperature, seed: 3,
        guided_regex: regex,
      });
      const choice = completion.choices[0];
      assert.equal(choice.finish_reason, 'stop', choice.message.content);
      assert.match(choice.message.content, whole);
    }
  });

  test('a bad parameter is a BadRequestError', async () => {
    await assert.rejects(client.completions.create({ model: MODEL, prompt: 'x', n: 0 }), (err) => {
      assert.ok(err instanceof OpenAI.BadRequestError, String(err));
      assert.equal(err.status, 400);
      assert.equal(err.param, 'n');
      assert.equal(err.type, 'invalid_request_error');
      return true;
    });
  });

  test('an unknown model is a NotFoundError', async () => {
    await assert.rejects(client.chat.completions.create({ model: 'gpt-4o', messages: [{ role: 'user', content: 'x' }] }),
      (err) => {
        assert.ok(err instanceof OpenAI.NotFoundError, String(err));
        assert.equal(err.status, 404);
        assert.equal(err.code, 'model_not_found');
        return true;
      });
  });
});

// qwen3moe-tiny in `dir` with a tokenizer.json of byte tokens (GPT-2's byte-level characters, ids 0..255, no
// merges; ChatML's markers 509..511), <|im_end|> its EOS, room for 2048 positions (the tools make a long prompt),
// and a chat template with the markers of one that knows tools (<tools>, <tool_call>): odmoe writes Qwen's prompt.
function qwenWithToolTemplate(dir) {
  const model = path.join(dir, 'qwen');
  fs.mkdirSync(model);
  fs.symlinkSync(path.join(qwenDir, 'model.safetensors'), path.join(model, 'model.safetensors'));
  const config = JSON.parse(fs.readFileSync(path.join(qwenDir, 'config.json'), 'utf8'));
  Object.assign(config, { max_position_embeddings: 2048, eos_token_id: 511 });
  fs.writeFileSync(path.join(model, 'config.json'), JSON.stringify(config));
  const printable = [];
  for (let b = 0; b < 256; b += 1) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) printable.push(b);
  }
  const vocab = {};
  let extra = 0;
  for (let b = 0; b < 256; b += 1) {
    vocab[String.fromCodePoint(printable.includes(b) ? b : 256 + extra++)] = b;
  }
  const special = (id, content) => ({ id, content, special: true });
  fs.writeFileSync(path.join(model, 'tokenizer.json'), JSON.stringify({
    added_tokens: [special(509, '<|endoftext|>'), special(510, '<|im_start|>'), special(511, '<|im_end|>')],
    pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, use_regex: true },
    post_processor: { type: 'ByteLevel' }, decoder: { type: 'ByteLevel' },
    model: { type: 'BPE', vocab, merges: [] },
  }));
  fs.writeFileSync(path.join(model, 'tokenizer_config.json'), JSON.stringify({
    eos_token: '<|im_end|>',
    chat_template: "{%- if tools %}<tools>{{ tools }}</tools><tool_call>{%- endif %}{%- for message in messages %}" +
      "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}",
  }));
  return model;
}

describe('the OpenAI SDK calling tools on a cluster serving qwen3moe-tiny', { skip: haveQwen ? false : `${qwenDir} is missing` }, () => {
  let dir;
  let cluster;
  let client;
  const weather = {
    type: 'function',
    function: {
      name: 'get_weather', description: 'The weather in a city.',
      parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 4 } }, required: ['city'] },
    },
  };
  const now = { type: 'function', function: { name: 'now', description: 'The time.' } };
  const base = {
    model: 'qwen', messages: [{ role: 'user', content: 'Weather in Oslo?' }], tools: [weather, now], max_tokens: 120,
    temperature: 1, seed: 7, n: 3,
  };

  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'odmoe-http-js-tools-'));
    cluster = await startCluster(dir, qwenWithToolTemplate(dir));
    client = cluster.client;
  });

  after(() => {
    if (cluster) cluster.down();
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  // The SDK's stream helper joins each choice's delta.tool_calls; they must be the whole answer's calls.
  async function wholeAndStreamed(params) {
    const whole = await client.chat.completions.create(params);
    const streamed = await client.beta.chat.completions.stream(params).finalChatCompletion();
    assert.equal(streamed.choices.length, whole.choices.length);
    for (const [i, choice] of whole.choices.entries()) {
      const other = streamed.choices[i];
      assert.equal(other.finish_reason, choice.finish_reason, `choice ${i}`);
      const calls = (choice.message.tool_calls ?? []).map((c) => [c.type, c.function.name, c.function.arguments]);
      const joined = (other.message.tool_calls ?? []).map((c) => [c.type, c.function.name, c.function.arguments]);
      assert.deepEqual(joined, calls, `choice ${i}`);
      if (calls.length === 0) assert.equal(other.message.content, choice.message.content, `choice ${i}`);
    }
    return whole;
  }

  test('a named function: the SDK reads its call, streamed and whole alike', async () => {
    const whole = await wholeAndStreamed({ ...base, tool_choice: { type: 'function', function: { name: 'get_weather' } } });
    let done = 0;
    for (const choice of whole.choices) {
      assert.equal(choice.message.content, null);
      assert.equal(choice.message.tool_calls.length, 1);
      const [call] = choice.message.tool_calls;
      assert.match(call.id, /^call_[A-Za-z0-9]{24}$/);
      assert.equal(call.function.name, 'get_weather');
      if (choice.finish_reason !== 'stop') continue;  // whitespace may fill max_tokens
      done += 1;
      const args = JSON.parse(call.function.arguments);
      assert.deepEqual(Object.keys(args), ['city'], call.function.arguments);
      assert.ok([...args.city].length <= 4, call.function.arguments);
    }
    assert.ok(done >= 1, JSON.stringify(whole.choices));
  });

  test('"required": a list of the tools\' calls, finish_reason tool_calls; the conversation goes on with one', async () => {
    const whole = await wholeAndStreamed({ ...base, tool_choice: 'required' });
    const made = whole.choices.filter((c) => c.finish_reason === 'tool_calls');
    assert.ok(made.length >= 1, JSON.stringify(whole.choices));
    for (const choice of made) {
      assert.equal(choice.message.content, null);
      for (const call of choice.message.tool_calls) {
        assert.ok(['get_weather', 'now'].includes(call.function.name), call.function.name);
        const args = JSON.parse(call.function.arguments);
        assert.deepEqual(Object.keys(args), call.function.name === 'now' ? [] : ['city'], call.function.arguments);
      }
    }
    const [call] = made[0].message.tool_calls;
    const next = await client.chat.completions.create({
      model: 'qwen', tools: [weather, now], max_tokens: 4,
      messages: [...base.messages, made[0].message, { role: 'tool', tool_call_id: call.id, content: '-3 and snow' }],
    });
    assert.ok(next.usage.prompt_tokens > whole.usage.prompt_tokens, JSON.stringify(next.usage));
  });

  test('a tool_choice naming no tool is a BadRequestError naming it', async () => {
    await assert.rejects(client.chat.completions.create({
      ...base, n: 1, tool_choice: { type: 'function', function: { name: 'later' } },
    }), (err) => {
      assert.ok(err instanceof OpenAI.BadRequestError, String(err));
      assert.equal(err.param, 'tool_choice');
      assert.match(err.message, /names the function 'later', which is not one of 'tools'/);
      return true;
    });
  });
});
