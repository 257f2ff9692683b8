// Safe to leave running on a shared machine: what a hostile local user, a
// hostile document (through a model's tool calls) or a hostile channel
// message can and cannot make the daemon do. The real binary, real
// clients, a local model server for real tool calls.

import assert from "node:assert/strict";
import { execFile, execFileSync, spawn } from "node:child_process";
import { createHmac } from "node:crypto";
import { existsSync, readFileSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import http from "node:http";
import net from "node:net";
import path from "node:path";
import { after, before, describe, test } from "node:test";

import {
  api,
  bin,
  connectStream,
  initialize,
  openStream,
  parseSseBlock,
  rawUnix,
  script,
  startDaemon,
  tempDir,
  textPrompt,
  transports,
  wsStream,
} from "./lib/daemon.mjs";
import { openai, startMockModel, userSide } from "./lib/mockmodel.mjs";

const MODEL_KEY = "sk-model-SECRET-4f1e2d";
const HOOK_SECRET = "hook-SECRET-77aa";
const DAEMON_TOKEN = "daemon-token-SECRET-9c3b";

let mock;
let daemon; // the daemon most tests share
let outside; // a directory next to every session's, that must stay untouched
let chanDir;
let configPath;

before(async () => {
  mock = await startMockModel();
  outside = tempDir();
  writeFileSync(path.join(outside, "secret.txt"), "TOP SECRET");
  chanDir = tempDir();
  writeFileSync(path.join(chanDir, "inside.txt"), "channel notes");
  const dir = tempDir();
  const config = path.join(dir, "tiller.toml");
  configPath = config;
  writeFileSync(
    config,
    `
[engine.mock]
kind = "openai"
base_url = "${mock.url}/v1"
model = "m"
api_key_env = "MOCK_MODEL_KEY"
retry_base = "10ms"

[tools]
# File tools and commands run without asking: confinement, not
# permission, is what keeps them in.
permission_mode = "allow-all"

[channels.hook]
secret_env = "HOOK_SECRET"
cwd = "${chanDir}"
engine = "mock"

[delivery]
allowed_hosts = ["127.0.0.1"]
`,
  );
  daemon = await startDaemon({
    dataDir: dir,
    args: ["--config", config],
    env: {
      MOCK_MODEL_KEY: MODEL_KEY,
      HOOK_SECRET,
      TILLER_SERVER__TOKEN: DAEMON_TOKEN,
      TILLER_LIMITS__HTTP_HEADER_TIMEOUT: "1s",
      TILLER_LIMITS__SUBSCRIBER_QUEUE: "64",
      TILLER_TURN__STALL_TIMEOUT: "20s",
    },
  });
});

after(async () => {
  await daemon?.stop();
  await mock?.close();
});

const until = async (pred, ms = 5000, what = "condition") => {
  for (let i = 0; i < ms / 20; i++) {
    if (await pred()) return;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new Error(`${what} not met in time`);
};

/** A session on the mock model engine in `cwd`, over HTTP. */
async function modelSession(cwd) {
  const res = await api(daemon, "POST", "/api/sessions", { cwd, engine: "mock" });
  assert.equal(res.status, 201, JSON.stringify(res.body));
  return res.body.id;
}

/** Runs one model turn that makes `calls`, then answers "done"; returns the tool results the model saw. */
async function runCalls(sid, calls) {
  const n = mock.requests.length;
  mock.reply({ events: openai.tools(calls) }, { events: openai.text("done") });
  const stream = await openStream(daemon, sid, {});
  try {
    const res = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: "go" });
    assert.equal(res.status, 202, JSON.stringify(res.body));
    await stream.until(() => stream.events.some((e) => e.data.type === "turn_complete" || e.data.type === "turn_error"), 30000);
    const terminal = stream.events.find((e) => e.data.type === "turn_complete" || e.data.type === "turn_error");
    assert.equal(terminal.data.type, "turn_complete", JSON.stringify(terminal.data));
  } finally {
    stream.close();
  }
  const second = mock.requests.slice(n)[1];
  assert.ok(second, "the model got the tool results");
  return Object.fromEntries(userSide(second).filter((m) => m.role === "tool").map((m) => [m.id, m.text]));
}

function sign(body, ts = Math.floor(Date.now() / 1000)) {
  const mac = createHmac("sha256", HOOK_SECRET).update(`${ts}.${body}`).digest("hex");
  return { "content-type": "application/json", "x-tiller-timestamp": String(ts), "x-tiller-signature": `sha256=${mac}` };
}

async function channelPost(d, body) {
  const res = await fetch(`${d.http}/api/channels/hook/prompts`, { method: "POST", headers: sign(body), body });
  return { status: res.status, body: await res.json() };
}

describe("authentication by default", () => {
  let d;
  before(async () => {
    d = await startDaemon(); // no token configured: one is generated
  });
  after(() => d?.stop());

  test("the generated token lives in the data directory, 0600, with the directory 0700 and the store 0600", () => {
    assert.ok(d.token && d.token.length >= 32, "a token was generated");
    const mode = (p) => statSync(p).mode & 0o777;
    assert.equal(mode(d.tokenFile), 0o600);
    assert.equal(mode(d.dataDir), 0o700);
    for (const f of ["tiller.db", "tiller.db-wal", "tiller.db-shm", "tiller.sock"]) {
      const p = path.join(d.dataDir, f);
      if (existsSync(p)) assert.equal(mode(p), 0o600, f);
    }
    assert.ok(!d.log().includes(d.token), "the token is never logged");
  });

  test("an unauthenticated local client is refused on HTTP, SSE and /acp; the token works on all three", async () => {
    const none = { authorization: undefined };
    assert.equal((await api(d, "GET", "/api/sessions", undefined, none)).status, 401);
    assert.equal((await api(d, "POST", "/api/sessions", { cwd: "/" }, none)).status, 401);
    const sid = (await api(d, "POST", "/api/sessions", { cwd: "/" })).body.id;
    assert.ok(sid);
    // SSE: no token, a wrong one, or the token in the query string.
    for (const [url, headers] of [
      [`/api/sessions/${sid}/events`, {}],
      [`/api/sessions/${sid}/events`, { authorization: "Bearer wrong" }],
      [`/api/sessions/${sid}/events?token=${d.token}`, {}],
    ]) {
      const res = await fetch(`${d.http}${url}`, { headers });
      assert.equal(res.status, 401, url);
      await res.body?.cancel();
    }
    const s = await openStream(d, sid);
    await s.until(() => s.events.some((e) => e.event === "session_snapshot"));
    s.close();
    // /acp: the upgrade is refused without the token.
    const refused = await new Promise((resolve) => {
      const ws = new WebSocket(d.ws);
      ws.onopen = () => resolve("opened");
      ws.onerror = () => resolve("refused");
    });
    assert.equal(refused, "refused");
    const c = connectStream(wsStream(d));
    try {
      await initialize(c);
      const res = await c.request("session/new", { cwd: "/", mcpServers: [] });
      assert.ok(res.sessionId);
    } finally {
      c.close();
    }
    // The unix socket (0600) needs no token.
    const u = await transports.unix(d);
    try {
      await initialize(u);
    } finally {
      u.close();
    }
    // /metrics is behind the token too; probes are not.
    assert.equal((await fetch(`${d.http}/metrics`)).status, 401);
    assert.equal((await fetch(`${d.http}/metrics`, { headers: d.auth })).status, 200);
    assert.equal((await fetch(`${d.http}/healthz`)).status, 200);
  });

  test("no token on a command line: `--token` is gone, and the daemons here show none in /proc", async () => {
    const cmdline = readFileSync(`/proc/${daemon.child.pid}/cmdline`, "utf8");
    assert.ok(!cmdline.includes(DAEMON_TOKEN), cmdline);
    const child = spawn(bin, ["serve", "--data-dir", tempDir(), "--listen", "127.0.0.1:0", "--token", "visible"], { stdio: ["ignore", "ignore", "pipe"] });
    let err = "";
    child.stderr.on("data", (x) => (err += x));
    const killer = setTimeout(() => child.kill(), 5000); // it must not start
    const code = await new Promise((r) => child.on("close", r));
    clearTimeout(killer);
    assert.equal(code, 2, err);
    assert.match(err, /--token/);
  });

  test("[metrics] enabled = false is honoured", async () => {
    const m = await startDaemon({ env: { TILLER_METRICS__ENABLED: "false" } });
    try {
      assert.equal((await fetch(`${m.http}/metrics`, { headers: m.auth })).status, 404);
    } finally {
      await m.stop();
    }
  });

  test("admin commands and `tiller acp --connect ws://` find the token file themselves", async () => {
    const env = { ...process.env, TILLER_STORE__DATA_DIR: d.dataDir };
    const out = await new Promise((resolve) =>
      execFile(bin, ["sessions", "list", "--url", d.http], { env }, (err, stdout, stderr) =>
        resolve({ code: err ? err.code : 0, stdout, stderr }),
      ),
    );
    assert.equal(out.code, 0, out.stderr);
    assert.ok(Array.isArray(JSON.parse(out.stdout).sessions));
    const child = spawn(bin, ["acp", "--connect", d.ws], { env, stdio: ["pipe", "pipe", "inherit"] });
    child.stdin.end(JSON.stringify({ jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: 1 } }) + "\n");
    let text = "";
    for await (const chunk of child.stdout) text += chunk;
    assert.equal(JSON.parse(text.trim().split("\n")[0]).result.protocolVersion, 1);
  });

  test("the Web Shell's bootstrap link yields an HttpOnly, SameSite=Strict cookie and a clean address bar", async () => {
    const { launch, page: newPage } = await import("./lib/browser.mjs");
    const browser = await launch();
    try {
      const p = await newPage(browser);
      await p.goto(`${d.http}/?token=${d.token}`);
      await p.waitForSelector("#state");
      await p.waitForFunction(() => document.querySelectorAll("#session-list li").length > 0);
      assert.ok(p.url().startsWith(`${d.http}/`) && !p.url().includes("token"), `the token left the address bar: ${p.url()}`);
      const cookies = await p.context().cookies();
      assert.equal(cookies.length, 1, JSON.stringify(cookies));
      assert.equal(cookies[0].httpOnly, true);
      assert.equal(cookies[0].sameSite, "Strict");
      assert.notEqual(cookies[0].value, d.token, "the cookie is not the token");
      assert.equal(await p.evaluate(() => document.cookie), "", "scripts cannot read it");
      // Nor is it in the page's history.
      assert.ok(!(await p.evaluate(() => location.href + document.referrer)).includes(d.token));
      // A browser without the cookie is told how to sign in, and sees no data.
      const q = await newPage(browser);
      await q.goto(`${d.http}/`);
      await q.waitForSelector("#sign-in");
      assert.equal(await q.$$eval("#session-list li", (l) => l.length), 0);
      // Nobody can frame it.
      const res = await fetch(`${d.http}/`);
      assert.equal(res.headers.get("x-frame-options"), "DENY");
      assert.match(res.headers.get("content-security-policy"), /frame-ancestors 'none'/);
      assert.equal(res.headers.get("referrer-policy"), "no-referrer");
    } finally {
      await browser.close();
    }
  });
});

describe("spawning is configured, never requested", () => {
  test("a stdio MCP server not on the allow-list is refused and never started; the session still works", async () => {
    const marker = path.join(tempDir(), "started");
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const res = await c.request("session/new", {
        cwd: tempDir(),
        mcpServers: [
          { name: "evil", command: process.execPath, args: ["-e", `require("fs").writeFileSync(${JSON.stringify(marker)}, "ran")`], env: [] },
          { type: "http", name: "inner", url: "http://127.0.0.1:9/mcp", headers: [] },
        ],
      });
      const sid = res.sessionId;
      await new Promise((r) => setTimeout(r, 500));
      assert.ok(!existsSync(marker), "the command never ran");
      const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=50`);
      const servers = Object.fromEntries(h.body.events.filter((e) => e.type === "mcp_server").map((e) => [e.data.name, e.data.error]));
      assert.match(servers.evil, /allowed_commands/);
      assert.match(servers.inner, /allowed_hosts/);
      assert.equal((await c.request("session/prompt", textPrompt(sid, script([{ say: "fine" }])))).stopReason, "end_turn");
    } finally {
      c.close();
    }
  });
});

describe("tools cannot leave their directory", () => {
  test("dangling and outside links, `..` and absolute paths fail and create nothing outside; a FIFO read fails at once", async () => {
    const root = tempDir();
    symlinkSync(path.join(outside, "created-through-link.txt"), path.join(root, "dangling"));
    symlinkSync(outside, path.join(root, "out"));
    symlinkSync(path.join(outside, "secret.txt"), path.join(root, "secret-link"));
    execFileSync("mkfifo", [path.join(root, "pipe")]);
    writeFileSync(path.join(root, "ok.txt"), "inside");
    const sid = await modelSession(root);
    const started = Date.now();
    const r = await runCalls(sid, [
      { id: "w_dangling", name: "write_file", args: { path: "dangling", content: "escaped" } },
      { id: "r_dir_link", name: "read_file", args: { path: "out/secret.txt" } },
      { id: "r_file_link", name: "read_file", args: { path: "secret-link" } },
      { id: "r_dotdot", name: "read_file", args: { path: `../${path.basename(outside)}/secret.txt` } },
      { id: "r_abs", name: "read_file", args: { path: "/etc/hostname" } },
      { id: "w_abs", name: "write_file", args: { path: path.join(outside, "abs.txt"), content: "escaped" } },
      { id: "w_dir_link", name: "write_file", args: { path: "out/new.txt", content: "escaped" } },
      { id: "g_abs", name: "grep", args: { pattern: "SECRET", path: outside } },
      { id: "fifo", name: "read_file", args: { path: "pipe" } },
      { id: "ok", name: "read_file", args: { path: "ok.txt" } },
    ]);
    assert.ok(Date.now() - started < 15000, "the FIFO did not block the turn");
    for (const id of ["w_dangling", "r_dir_link", "r_file_link", "r_dotdot", "r_abs", "w_abs", "w_dir_link", "g_abs", "fifo"]) {
      assert.ok(!r[id].includes("TOP SECRET"), `${id} leaked: ${r[id]}`);
      assert.doesNotMatch(r[id], /^wrote|^replaced/, `${id} wrote: ${r[id]}`);
    }
    assert.match(r.fifo, /FIFO/);
    assert.match(r.r_abs, /outside/);
    assert.equal(r.ok, "inside");
    for (const f of ["created-through-link.txt", "abs.txt", "new.txt"]) {
      assert.ok(!existsSync(path.join(outside, f)), `${f} was created outside`);
    }
    assert.equal(readFileSync(path.join(outside, "secret.txt"), "utf8"), "TOP SECRET");
  });

  test("a database kept in a session's directory, new at start, is the daemon's own data, its log files too", async () => {
    const home = tempDir();
    const db = path.join(home, "state", "tiller.db");
    const d = await startDaemon({
      args: ["--config", configPath],
      env: { MOCK_MODEL_KEY: MODEL_KEY, HOOK_SECRET, TILLER_STORE__KIND: "sqlite", TILLER_STORE__PATH: db },
    });
    try {
      const sid = (await api(d, "POST", "/api/sessions", { cwd: home, engine: "mock" })).body.id;
      assert.ok(existsSync(`${db}-wal`), "the database has its log");
      const n = mock.requests.length;
      mock.reply(
        {
          events: openai.tools([
            { id: "db", name: "read_file", args: { path: "state/tiller.db" } },
            { id: "wal", name: "read_file", args: { path: "state/tiller.db-wal" } },
            { id: "shm", name: "write_file", args: { path: "state/tiller.db-shm", content: "x" } },
            { id: "new", name: "write_file", args: { path: "state/tiller.db-journal", content: "x" } },
          ]),
        },
        { events: openai.text("done") },
      );
      assert.equal((await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: "go" })).status, 202);
      await until(() => mock.requests.length >= n + 2, 10000, "the model's second call");
      const r = Object.fromEntries(userSide(mock.requests[n + 1]).filter((m) => m.role === "tool").map((m) => [m.id, m.text]));
      for (const id of ["db", "wal", "shm", "new"]) assert.match(r[id], /daemon's own data/, `${id}: ${r[id]}`);
      assert.ok(!existsSync(`${db}-journal`), "nothing was created");
    } finally {
      await d.stop();
    }
  });

  test("a session whose directory holds the daemon's data cannot touch it", async () => {
    // A session in $HOME contains ~/.local/share/tiller.
    const home = tempDir();
    const dataDir = path.join(home, ".local/share/tiller");
    // The daemon's own files include the SQLite database: kept in the data
    // directory for this test also when the suite runs on PostgreSQL.
    const d = await startDaemon({
      dataDir,
      args: ["--config", configPath],
      env: { MOCK_MODEL_KEY: MODEL_KEY, HOOK_SECRET, TILLER_STORE__KIND: "sqlite" },
    });
    try {
      writeFileSync(path.join(home, "notes.txt"), "mine");
      const sid = (await api(d, "POST", "/api/sessions", { cwd: home, engine: "mock" })).body.id;
      const n = mock.requests.length;
      mock.reply(
        {
          events: openai.tools([
            { id: "tok", name: "read_file", args: { path: ".local/share/tiller/token" } },
            { id: "db", name: "read_file", args: { path: path.join(dataDir, "tiller.db") } },
            { id: "ls", name: "list_dir", args: { path: ".local/share/tiller" } },
            { id: "grep", name: "grep", args: { pattern: d.token } },
            { id: "w", name: "write_file", args: { path: ".local/share/tiller/token", content: "mine now" } },
            { id: "ok", name: "read_file", args: { path: "notes.txt" } },
          ]),
        },
        { events: openai.text("done") },
      );
      assert.equal((await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: "go" })).status, 202);
      await until(() => mock.requests.length >= n + 2, 10000, "the model's second call");
      const r = Object.fromEntries(userSide(mock.requests[n + 1]).filter((m) => m.role === "tool").map((m) => [m.id, m.text]));
      for (const id of ["tok", "db", "ls", "w"]) assert.match(r[id], /daemon's own data/, `${id}: ${r[id]}`);
      assert.equal(r.grep, "no matches");
      assert.equal(r.ok, "mine");
      assert.equal(readFileSync(path.join(dataDir, "token"), "utf8").trim(), d.token);
    } finally {
      await d.stop();
    }
  });

  test("a command's `setsid` children die with it", async () => {
    const sid = await modelSession(tempDir());
    // Durations unique to this run name its processes.
    const [a, b] = [`313.${process.pid}`, `314.${process.pid}`];
    const alive = () =>
      execFileSync("ps", ["-eo", "args"], { encoding: "utf8" })
        .split("\n")
        .filter((l) => l.trim() === `sleep ${a}` || l.trim() === `sleep ${b}`);
    const r = await runCalls(sid, [
      { id: "bg", name: "shell", args: { command: `setsid sleep ${a} >/dev/null 2>&1 & (setsid sleep ${b} >/dev/null 2>&1 &); echo started` } },
    ]);
    assert.match(r.bg, /started/);
    await until(() => alive().length === 0, 5000, "no sleep left");
  });

  test("\"always allow\" on one shell command does not allow every later command", async () => {
    const root = tempDir();
    const sid = await modelSession(root);
    await api(daemon, "PUT", `/api/sessions/${sid}/options/permission_mode`, { value: "ask" });
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      await c.request("session/resume", { sessionId: sid, cwd: root, mcpServers: [] });
      c.answer = async () => ({ outcome: { outcome: "selected", optionId: "allow_always" } });
      mock.reply({ events: openai.tools([{ id: "a1", name: "shell", args: { command: "echo one" } }]) }, { events: openai.text("ok") });
      await c.request("session/prompt", textPrompt(sid, "first"));
      assert.equal(c.permissionRequests.length, 1);
      // The same command again runs without asking; another one asks.
      c.answer = async () => ({ outcome: { outcome: "selected", optionId: "reject_once" } });
      mock.reply(
        { events: openai.tools([{ id: "a2", name: "shell", args: { command: "echo one more" } }]) },
        { events: openai.tools([{ id: "a3", name: "shell", args: { command: "touch pwned" } }]) },
        { events: openai.text("ok") },
      );
      await c.request("session/prompt", textPrompt(sid, "second"));
      assert.equal(c.permissionRequests.length, 2, "`touch pwned` asked");
      assert.ok(!existsSync(path.join(root, "pwned")), "and, denied, did not run");
    } finally {
      c.close();
    }
  });

  test("`env` run by shell shows none of the daemon's secrets", async () => {
    const sid = await modelSession(tempDir());
    const r = await runCalls(sid, [{ id: "env", name: "shell", args: { command: "env" } }]);
    assert.match(r.env, /PATH=/);
    for (const secret of [MODEL_KEY, HOOK_SECRET, DAEMON_TOKEN]) {
      assert.ok(!r.env.includes(secret), `the child saw ${secret}`);
    }
    assert.doesNotMatch(r.env, /TILLER_/);
    // Nor does the stored log.
    const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=200`);
    const text = JSON.stringify(h.body);
    for (const secret of [MODEL_KEY, HOOK_SECRET, DAEMON_TOKEN]) assert.ok(!text.includes(secret));
  });

  test("a 400 MB command output keeps the daemon's resident memory within 100 MB of where it was", async (t) => {
    const pid = daemon.child.pid;
    const status = () => readFileSync(`/proc/${pid}/status`, "utf8");
    const kb = (field) => Number(status().match(new RegExp(`^${field}:\\s+(\\d+) kB`, "m"))[1]);
    // Reset the peak, so it measures this call alone.
    writeFileSync(`/proc/${pid}/clear_refs`, "5");
    const before = kb("VmRSS");
    const sid = await modelSession(tempDir());
    const r = await runCalls(sid, [{ id: "big", name: "shell", args: { command: "head -c 400000000 /dev/zero | tr '\\0' x" } }]);
    const peak = kb("VmHWM");
    t.diagnostic(`400 MB of output: RSS ${before} kB before, peak ${peak} kB (+${Math.round((peak - before) / 1024)} MB)`);
    assert.ok(peak - before < 100 * 1024, `peak RSS grew by ${Math.round((peak - before) / 1024)} MB (before ${before} kB, peak ${peak} kB)`);
    assert.ok(r.big.length < 200_000, `${r.big.length} bytes reached the model`);
    assert.ok(r.big.includes("bytes cut"), `the output was bounded and says so: ...${r.big.slice(-300)}`);
  });
});

describe("unattended turns cannot reach beyond their task", () => {
  test("a channel session works inside its configured cwd and cannot read /etc/hostname", async () => {
    const n = mock.requests.length;
    mock.reply(
      {
        events: openai.tools([
          { id: "inside", name: "read_file", args: { path: "inside.txt" } },
          { id: "host", name: "read_file", args: { path: "/etc/hostname" } },
          { id: "up", name: "read_file", args: { path: "../../../../etc/hostname" } },
        ]),
      },
      { events: openai.text("done") },
    );
    const body = JSON.stringify({ text: "summarize" });
    const res = await channelPost(daemon, body);
    assert.equal(res.status, 202, JSON.stringify(res.body));
    await until(() => mock.requests.length >= n + 2, 10000, "the model's second call");
    const rec = await api(daemon, "GET", `/api/sessions/${res.body.sessionId}`);
    assert.equal(rec.body.cwd, chanDir);
    const tools = Object.fromEntries(userSide(mock.requests[n + 1]).filter((m) => m.role === "tool").map((m) => [m.id, m.text]));
    assert.equal(tools.inside, "channel notes");
    const hostname = readFileSync("/etc/hostname", "utf8").trim();
    for (const id of ["host", "up"]) {
      assert.match(tools[id], /outside/);
      // The refusal names the session's directory, whose random name may
      // contain a short host name: only the rest must not.
      assert.ok(!hostname || !tools[id].replaceAll(chanDir, "").includes(hostname), tools[id]);
    }
  });

  test("a channel naming a session it did not create gets 403; its own session it may prompt", async () => {
    const person = (await api(daemon, "POST", "/api/sessions", { cwd: "/" })).body.id;
    const denied = await channelPost(daemon, JSON.stringify({ sessionId: person, text: script([{ say: "hi" }]) }));
    assert.equal(denied.status, 403, JSON.stringify(denied.body));
    assert.equal(denied.body.error.errorKind, "forbidden");
    const h = await api(daemon, "GET", `/api/sessions/${person}/history?limit=20`);
    assert.ok(!h.body.events.some((e) => e.type === "prompt_started"), "nothing reached the person's session");
    const unknown = await channelPost(daemon, JSON.stringify({ sessionId: "00000000-0000-4000-8000-000000000000", text: "x" }));
    assert.equal(unknown.status, 403);
    mock.reply({ events: openai.text("first") }, { events: openai.text("second") });
    const own = await channelPost(daemon, JSON.stringify({ text: "first" }));
    assert.equal(own.status, 202);
    const again = await channelPost(daemon, JSON.stringify({ sessionId: own.body.sessionId, text: "second" }));
    assert.equal(again.status, 202, JSON.stringify(again.body));
  });

  test("an unattended turn whose call would ask gets a refused call and settles at once", async () => {
    const sid = (await api(daemon, "POST", "/api/sessions", { cwd: "/" })).body.id;
    await api(daemon, "PUT", `/api/sessions/${sid}/options/permission_mode`, { value: "ask" });
    const s = await openStream(daemon, sid, {});
    try {
      const text = script([{ tool: { name: "shell", input: { command: "rm -rf ~" }, output: "gone" } }, { say: "after" }]);
      const res = await api(daemon, "POST", `/api/sessions/${sid}/notifications`, { taskId: "t1", text });
      assert.equal(res.status, 202);
      await s.until(() => s.events.some((e) => ["turn_complete", "turn_error"].includes(e.data.type)), 2500);
      const evs = s.events.map((e) => e.data);
      assert.ok(!evs.some((e) => e.type === "permission_requested"), "nobody was asked");
      const failed = evs.find((e) => e.type === "tool_call_update" && e.data.status === "failed");
      assert.equal(failed.data.error.errorKind, "permission_unavailable");
      assert.match(failed.data.output, /unattended/);
      assert.equal(evs.find((e) => e.type === "turn_complete").data.stopReason, "end_turn");
    } finally {
      s.close();
    }
  });
});

describe("webhooks", () => {
  /** A server that counts hits and answers with `respond(port)`. */
  async function server(respond) {
    const hits = [];
    const srv = http.createServer((req, res) => {
      hits.push(req.url);
      req.resume();
      respond(res);
    });
    await new Promise((r) => srv.listen(0, "127.0.0.1", r));
    return { hits, port: srv.address().port, close: () => srv.close() };
  }

  test("a webhook that redirects is not followed", async () => {
    const target = await server((res) => res.writeHead(200).end("ok"));
    const hook = await server((res) => res.writeHead(302, { location: `http://127.0.0.1:${target.port}/stolen` }).end());
    try {
      const sid = (await api(daemon, "POST", "/api/sessions", { cwd: "/" })).body.id;
      const res = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, {
        text: script([{ say: "final words" }]),
        _meta: { tiller: { delivery: { webhook: `http://127.0.0.1:${hook.port}/hook` } } },
      });
      assert.equal(res.status, 202);
      // The first attempt, and its retry a second later.
      await until(() => hook.hits.length >= 2, 8000, "two attempts");
      assert.deepEqual(target.hits, [], "the redirect target got nothing");
    } finally {
      target.close();
      hook.close();
    }
  });

  test("a slow webhook host delays no other host's delivery", async () => {
    const stuck = [];
    const slow = await server((res) => stuck.push(res)); // never answers
    const fast = await server((res) => res.writeHead(200).end("ok"));
    try {
      const sid = (await api(daemon, "POST", "/api/sessions", { cwd: "/" })).body.id;
      const deliver = (port, text) =>
        api(daemon, "POST", `/api/sessions/${sid}/prompts`, {
          text: script([{ say: text }]),
          _meta: { tiller: { delivery: { webhook: `http://127.0.0.1:${port}/hook` } } },
        });
      assert.equal((await deliver(slow.port, "to the slow one")).status, 202);
      await until(() => slow.hits.length > 0, 5000, "the slow host is being tried");
      const t0 = Date.now();
      assert.equal((await deliver(fast.port, "to the fast one")).status, 202);
      // Well inside the 10 s a delivery to the slow host may take.
      await until(() => fast.hits.length > 0, 5000, "the fast host's delivery");
      assert.ok(Date.now() - t0 < 5000);
    } finally {
      for (const r of stuck) r.socket?.destroy();
      slow.close();
      fast.close();
    }
  });

  test("a webhook whose name resolves to loopback is not followed when loopback is not allowed", async () => {
    const hook = await server((res) => res.writeHead(200).end("ok"));
    const d = await startDaemon({ env: { TILLER_DELIVERY__ALLOWED_HOSTS: '["localhost"]' } });
    try {
      const sid = (await api(d, "POST", "/api/sessions", { cwd: "/" })).body.id;
      const res = await api(d, "POST", `/api/sessions/${sid}/prompts`, {
        text: script([{ say: "final words" }]),
        // Slack's, Discord's and Teams' incoming webhooks carry their secret in the path.
        _meta: { tiller: { delivery: { webhook: `http://user:pa55word@localhost:${hook.port}/hook/T0SECRETPATH?key=abc` } } },
      });
      assert.equal(res.status, 202, JSON.stringify(res.body));
      await until(() => d.log().includes("webhook delivery failed"), 8000, "a failed attempt");
      assert.deepEqual(hook.hits, [], "nothing reached the loopback server");
      assert.match(d.log(), /loopback/);
      assert.ok(!d.log().includes("pa55word") && !d.log().includes("key=abc"), "credentials are never logged");
      assert.ok(!d.log().includes("T0SECRETPATH"), "nor the path, which may be the credential");
      assert.match(d.log(), new RegExp(`localhost:${hook.port}`), "the log names where");
    } finally {
      await d.stop();
      hook.close();
    }
  });
});

describe("resource bounds at the edges", () => {
  test("1,000 half-open HTTP connections are closed by the header timeout; the daemon still answers", async () => {
    const [host, port] = daemon.listen.split(":");
    const socks = await Promise.all(
      Array.from(
        { length: 1000 },
        () =>
          new Promise((resolve, reject) => {
            const s = net.connect(Number(port), host, () => {
              s.write("GET /api/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n"); // never finished
              resolve(s);
            });
            s.on("error", reject);
          }),
      ),
    );
    const closed = Promise.all(socks.map((s) => new Promise((r) => (s.destroyed ? r() : s.on("close", r)))));
    let done = false;
    closed.then(() => (done = true));
    await until(() => done, 15000, "every half-open connection closed");
    assert.equal((await api(daemon, "GET", "/api/sessions?limit=1")).status, 200);
  });

  test("HTTP connections over the cap get a 503 and are closed", async () => {
    const d = await startDaemon({ env: { TILLER_LIMITS__MAX_HTTP_CONNECTIONS: "4" } });
    const [host, port] = d.listen.split(":");
    const held = [];
    try {
      for (let i = 0; i < 4; i++) {
        held.push(await new Promise((r) => { const s = net.connect(Number(port), host, () => r(s)); }));
      }
      await new Promise((r) => setTimeout(r, 200));
      const reply = await new Promise((resolve) => {
        const s = net.connect(Number(port), host, () => s.write("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
        let buf = "";
        s.on("data", (x) => (buf += x));
        s.on("close", () => resolve(buf));
      });
      assert.match(reply, /^HTTP\/1\.1 503/);
      for (const s of held) s.destroy();
      await until(async () => (await fetch(`${d.http}/healthz`).catch(() => ({ status: 0 }))).status === 200, 5000, "room again");
    } finally {
      for (const s of held) s.destroy();
      await d.stop();
    }
  });

  test("eight session/loads of a 100,000-event session at once stay within 150 MB of resident memory", async (t) => {
    const d = await startDaemon();
    try {
      const c = await transports.unix(d);
      await initialize(c);
      const sid = (await c.request("session/new", { cwd: "/", mcpServers: [] })).sessionId;
      const steps = Array(10).fill({ say: "y" });
      await c.request("session/prompt", textPrompt(sid, script([{ repeat: { times: 10000, steps } }])));
      c.close();
      const pid = d.child.pid;
      const kb = (field) => Number(readFileSync(`/proc/${pid}/status`, "utf8").match(new RegExp(`^${field}:\\s+(\\d+) kB`, "m"))[1]);
      writeFileSync(`/proc/${pid}/clear_refs`, "5");
      const before = kb("VmRSS");
      const loads = await Promise.all(
        Array.from({ length: 8 }, async () => {
          const l = await transports.unix(d);
          await initialize(l);
          await l.request("session/load", { sessionId: sid, cwd: "/", mcpServers: [] });
          const text = l.updates
            .filter((u) => u.update.sessionUpdate === "agent_message_chunk")
            .map((u) => u.update.content.text)
            .join("");
          l.close();
          return text.length;
        }),
      );
      assert.deepEqual(loads, Array(8).fill(100000), "every load replayed all of it");
      const peak = kb("VmHWM");
      t.diagnostic(`8 loads of 100,000 events: RSS ${before} kB before, peak ${peak} kB (+${Math.round((peak - before) / 1024)} MB)`);
      assert.ok(peak - before < 150 * 1024, `peak RSS grew by ${Math.round((peak - before) / 1024)} MB`);
    } finally {
      await d.stop();
    }
  });

  test("out of file descriptors, the accept loop backs off and logs a line, not a flood; it recovers", async () => {
    const dataDir = tempDir();
    const child = spawn("sh", ["-c", `ulimit -n 40 && exec "$0" serve --data-dir "$1" --listen 127.0.0.1:0`, bin, dataDir], {
      env: { ...process.env, RUST_LOG: "warn,tiller=info" },
      stdio: ["ignore", "ignore", "pipe"],
    });
    let log = "";
    child.stderr.on("data", (x) => (log += x));
    const exited = new Promise((r) => child.on("exit", r));
    try {
      await until(() => log.includes("tiller is ready"), 15000, "the daemon starts");
      const sockPath = path.join(dataDir, "tiller.sock");
      const held = [];
      for (let i = 0; i < 60; i++) {
        const s = net.connect(sockPath);
        s.on("error", () => {});
        held.push(s);
      }
      await until(() => log.includes("accept failed"), 5000, "an accept failure");
      const ticks = () => readFileSync(`/proc/${child.pid}/stat`, "utf8").split(") ")[1].split(" ").slice(11, 13).reduce((a, b) => a + Number(b), 0);
      const t0 = ticks();
      await new Promise((r) => setTimeout(r, 2000));
      const cpu = (ticks() - t0) / 100; // seconds of CPU in two seconds
      assert.ok(cpu < 0.5, `the daemon spent ${cpu}s of CPU in 2s`);
      const lines = log.split("\n").filter((l) => l.includes("accept failed")).length;
      assert.ok(lines <= 3, `${lines} log lines`);
      for (const s of held) s.destroy();
      const c = await transports.unix({ socket: sockPath });
      await initialize(c);
      c.close();
    } finally {
      child.kill("SIGTERM");
      await exited;
    }
  });

  test("a slow SSE reader during a 20,000-chunk turn gets every event once, in order, without a resync", async () => {
    const d = await startDaemon({ env: { TILLER_LIMITS__SUBSCRIBER_QUEUE: "16" } });
    try {
      const sid = (await api(d, "POST", "/api/sessions", { cwd: "/w" })).body.id;
      const res = await fetch(`${d.http}/api/sessions/${sid}/events`, { headers: d.auth });
      const reader = res.body.getReader();
      const first = await reader.read(); // the snapshot
      await api(d, "POST", `/api/sessions/${sid}/prompts`, {
        text: script([{ repeat: { times: 10000, steps: [{ say: "x" }, { say: "x" }] } }]),
      });
      // Not reading while the turn streams far more than any buffer holds.
      const snap = async () => (await api(d, "GET", `/api/sessions/${sid}`)).body;
      await until(async () => (await snap()).state === "idle", 60000, "the turn ends");
      const last = (await snap()).lastSeq;
      const decoder = new TextDecoder();
      let buf = decoder.decode(first.value, { stream: true });
      const events = [];
      while (!events.some((e) => e.id === last)) {
        const { value, done } = await reader.read();
        assert.ok(!done, "the stream stays open");
        buf += decoder.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const ev = parseSseBlock(buf.slice(0, i));
          buf = buf.slice(i + 2);
          if (ev.event === "resync") assert.fail("told to resync");
          if (ev.event === "event") events.push({ id: ev.id, data: JSON.parse(ev.data) });
        }
      }
      await reader.cancel();
      const ids = events.map((e) => e.id);
      assert.deepEqual(ids, Array.from({ length: ids.length }, (_, k) => ids[0] + k), "contiguous, each once");
      assert.equal(ids.at(-1), last);
      const text = events.filter((e) => e.data.type === "agent_message_chunk").map((e) => e.data.data.text).join("");
      assert.equal(text, "x".repeat(20000), "nothing lost");
    } finally {
      await d.stop();
    }
  });

  test("a slow ACP reader during a 20,000-chunk turn still gets its prompt's response, and every chunk", async () => {
    const raw = await rawUnix(daemon);
    const messages = raw.messages;
    const send = (id, method, params) => raw.send(JSON.stringify({ jsonrpc: "2.0", id, method, params }));
    const reply = async (id) => {
      await until(() => messages.some((m) => m.id === id), 60000, `reply ${id}`);
      return messages.find((m) => m.id === id);
    };
    try {
      send(1, "initialize", { protocolVersion: 1 });
      await reply(1);
      send(2, "session/new", { cwd: "/", mcpServers: [] });
      const sid = (await reply(2)).result.sessionId;
      // Stop reading while the turn streams far more than any buffer holds.
      raw.pause();
      send(3, "session/prompt", textPrompt(sid, script([{ repeat: { times: 10000, steps: [{ say: "x" }, { say: "x" }] } }])));
      const snap = async () => (await api(daemon, "GET", `/api/sessions/${sid}`)).body;
      await until(async () => (await snap()).state === "idle" && (await snap()).lastSeq > 20000, 60000, "the turn ends");
      raw.resume();
      const res = await reply(3);
      assert.equal(res.result?.stopReason, "end_turn", JSON.stringify(res));
      const chunks = messages.filter((m) => m.method === "session/update" && m.params.update.sessionUpdate === "agent_message_chunk");
      assert.equal(chunks.map((m) => m.params.update.content.text).join(""), "x".repeat(20000), "nothing lost");
      assert.ok(chunks.length < 20000, `coalesced while behind: ${chunks.length} updates`);
      const i = messages.indexOf(res);
      assert.ok(messages.slice(i + 1).every((m) => m.method !== "session/update" || m.params.sessionId !== sid), "the response follows its turn's updates");
    } finally {
      raw.close();
    }
  });
});

