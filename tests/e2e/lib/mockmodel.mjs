// A local model server that streams in the real OpenAI Chat Completions and
// Anthropic Messages wire formats (server-sent events). Each request takes
// the next scripted reply from a queue; every request is recorded.

import http from "node:http";

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * Starts the server. `replies` are taken in order; a reply is one of:
 *  { status, headers?, body }                       a plain (error) answer
 *  { events: [{event?, data}], pace?, split?, hang?, drop? }   an SSE stream:
 *     pace   ms between events; split  write each event in pieces of this
 *     many bytes; hang  keep the stream open after the events; drop  destroy
 *     the socket after the events (a broken stream)
 *  { waitHeaders: ms }                              answer nothing for ms
 */
export async function startMockModel() {
  const replies = [];
  const requests = [];
  const closed = [];
  const server = http.createServer(async (req, res) => {
    let raw = "";
    for await (const chunk of req) raw += chunk;
    const entry = {
      path: req.url,
      headers: req.headers,
      body: raw ? JSON.parse(raw) : null,
      closedEarly: false,
    };
    requests.push(entry);
    let finished = false;
    res.on("close", () => {
      if (!finished) {
        entry.closedEarly = true;
        closed.push(entry);
      }
    });
    const reply = replies.shift() ?? { status: 500, body: { error: { type: "test", message: "no reply scripted" } } };
    if (typeof reply === "function") return reply(req, res, entry);
    if (reply.waitHeaders) {
      await sleep(reply.waitHeaders);
      if (!res.destroyed) res.end();
      finished = true;
      return;
    }
    if (reply.status) {
      res.writeHead(reply.status, { "content-type": "application/json", ...(reply.headers ?? {}) });
      res.end(JSON.stringify(reply.body ?? {}));
      finished = true;
      return;
    }
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
    for (const ev of reply.events) {
      if (res.destroyed) return;
      const data = typeof ev.data === "string" ? ev.data : JSON.stringify(ev.data);
      const text = (ev.event ? `event: ${ev.event}\n` : "") + `data: ${data}\n\n`;
      if (reply.split) {
        for (let i = 0; i < text.length; i += reply.split) {
          res.write(text.slice(i, i + reply.split));
          await sleep(1);
        }
      } else {
        res.write(text);
      }
      if (reply.pace) await sleep(reply.pace);
    }
    if (reply.drop) {
      await sleep(20);
      res.socket.destroy();
      return;
    }
    if (reply.hang) return; // until the client goes away
    finished = true;
    res.end();
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const { port } = server.address();
  return {
    url: `http://127.0.0.1:${port}`,
    replies,
    requests,
    closed,
    reply(...r) {
      replies.push(...r);
    },
    close: () =>
      new Promise((r) => {
        server.closeAllConnections();
        server.close(r);
      }),
  };
}

/** OpenAI Chat Completions stream builders. */
export const openai = {
  chunk: (delta, finish = null) => ({
    data: { id: "chatcmpl-1", object: "chat.completion.chunk", model: "mock", choices: [{ index: 0, delta, finish_reason: finish }] },
  }),
  /** A text reply, one chunk per word. */
  text(text, { finish = "stop", usage = [11, 7] } = {}) {
    const words = text.split(/(?<= )/);
    return [
      openai.chunk({ role: "assistant", content: "" }),
      ...words.map((w) => openai.chunk({ content: w })),
      openai.chunk({}, finish),
      { data: { id: "chatcmpl-1", object: "chat.completion.chunk", choices: [], usage: { prompt_tokens: usage[0], completion_tokens: usage[1], total_tokens: usage[0] + usage[1] } } },
      { data: "[DONE]" },
    ];
  },
  /** Parallel tool calls, each call's arguments split into `pieces`. */
  tools(calls, { pieces = 3, text = "" } = {}) {
    const out = [openai.chunk({ role: "assistant", content: text || null })];
    calls.forEach((c, index) => {
      out.push(openai.chunk({ tool_calls: [{ index, id: c.id, type: "function", function: { name: c.name, arguments: "" } }] }));
      const args = JSON.stringify(c.args);
      const size = Math.ceil(args.length / pieces);
      for (let i = 0; i < args.length; i += size) {
        out.push(openai.chunk({ tool_calls: [{ index, function: { arguments: args.slice(i, i + size) } }] }));
      }
    });
    out.push(openai.chunk({}, "tool_calls"));
    out.push({ data: "[DONE]" });
    return out;
  },
};

/** Anthropic Messages stream builders. */
export const anthropic = {
  start: (input = 10) => ({
    event: "message_start",
    data: { type: "message_start", message: { id: "msg_1", type: "message", role: "assistant", content: [], model: "mock", usage: { input_tokens: input, output_tokens: 1 } } },
  }),
  stop: (reason, output = 5) => [
    { event: "message_delta", data: { type: "message_delta", delta: { stop_reason: reason, stop_sequence: null }, usage: { output_tokens: output } } },
    { event: "message_stop", data: { type: "message_stop" } },
  ],
  text(text, { stop = "end_turn", input = 10, output = 5 } = {}) {
    return [
      anthropic.start(input),
      { event: "content_block_start", data: { type: "content_block_start", index: 0, content_block: { type: "text", text: "" } } },
      { event: "ping", data: { type: "ping" } },
      ...text.split(/(?<= )/).map((w) => ({
        event: "content_block_delta",
        data: { type: "content_block_delta", index: 0, delta: { type: "text_delta", text: w } },
      })),
      { event: "content_block_stop", data: { type: "content_block_stop", index: 0 } },
      ...anthropic.stop(stop, output),
    ];
  },
  /** A thinking block (its text in two deltas, then its signature) before `rest`'s blocks. */
  thinking(thought, signature, rest) {
    const shift = (e) =>
      e.data.index === undefined ? e : { ...e, data: { ...e.data, index: e.data.index + 1 } };
    const [start, ...more] = rest;
    const half = Math.ceil(thought.length / 2);
    return [
      start,
      { event: "content_block_start", data: { type: "content_block_start", index: 0, content_block: { type: "thinking", thinking: "" } } },
      { event: "content_block_delta", data: { type: "content_block_delta", index: 0, delta: { type: "thinking_delta", thinking: thought.slice(0, half) } } },
      { event: "content_block_delta", data: { type: "content_block_delta", index: 0, delta: { type: "thinking_delta", thinking: thought.slice(half) } } },
      { event: "content_block_delta", data: { type: "content_block_delta", index: 0, delta: { type: "signature_delta", signature } } },
      { event: "content_block_stop", data: { type: "content_block_stop", index: 0 } },
      ...more.map(shift),
    ];
  },
  tools(calls, { pieces = 3 } = {}) {
    const out = [anthropic.start()];
    calls.forEach((c, index) => {
      out.push({ event: "content_block_start", data: { type: "content_block_start", index, content_block: { type: "tool_use", id: c.id, name: c.name, input: {} } } });
      const args = JSON.stringify(c.args);
      const size = Math.ceil(args.length / pieces);
      for (let i = 0; i < args.length; i += size) {
        out.push({ event: "content_block_delta", data: { type: "content_block_delta", index, delta: { type: "input_json_delta", partial_json: args.slice(i, i + size) } } });
      }
      out.push({ event: "content_block_stop", data: { type: "content_block_stop", index } });
    });
    out.push(...anthropic.stop("tool_use"));
    return out;
  },
};

/** The messages a recorded request carried, provider-neutral: [{role, text|tool}] */
export function userSide(req) {
  const out = [];
  for (const m of req.body.messages) {
    if (typeof m.content === "string") out.push({ role: m.role, text: m.content, id: m.tool_call_id });
    else if (Array.isArray(m.content))
      for (const b of m.content) {
        if (b.type === "text") out.push({ role: m.role, text: b.text });
        if (b.type === "tool_result") out.push({ role: "tool", text: b.content, id: b.tool_use_id, isError: b.is_error });
      }
  }
  return out;
}
