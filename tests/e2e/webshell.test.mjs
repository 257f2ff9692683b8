// The Web Shell in headless Chromium against the real daemon.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { after, before, describe, test } from "node:test";

import { launch, page as newPage, screenshot } from "./lib/browser.mjs";
import { api, script, startDaemon } from "./lib/daemon.mjs";

const require = createRequire(import.meta.url);
const AXE = readFileSync(require.resolve("axe-core/axe.min.js"), "utf8");

let daemon;
let browser;

before(async () => {
  daemon = await startDaemon();
  browser = await launch();
});

after(async () => {
  await browser?.close();
  await daemon?.stop();
});

const call = { name: "read_file", input: { path: "x" }, output: "same" };
const LOOP = script([{ tools: Array(6).fill(call) }]);
const EN_LOOP = /repeated the same tool use or reached a safety limit/;
const ZH_LOOP = /模型重复使用了相同的工具或达到了安全上限/;

async function session() {
  return (await api(daemon, "POST", "/api/sessions", { cwd: "/web", title: `web ${Math.random().toString(36).slice(2, 7)}` })).body.id;
}

async function open(sid, opts) {
  const p = await newPage(browser, opts);
  // The bootstrap link: the daemon trades the token for a cookie and sends
  // the browser on to `/#sid`.
  await p.goto(`${daemon.http}/?token=${daemon.token}#${sid}`);
  await p.waitForSelector("#state[data-state]");
  return p;
}

async function send(p, text) {
  await p.fill("#prompt-text", text);
  await p.click("#send");
}

/** A TCP proxy in front of the daemon (the network between it and the
 * browser), listening on a free port, and the sockets it holds open. */
async function tcpProxy() {
  const net = await import("node:net");
  const [host, port] = daemon.listen.split(":");
  const sockets = new Set();
  const proxy = net.createServer((client) => {
    const upstream = net.connect(Number(port), host);
    client.pipe(upstream).pipe(client);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on("error", () => {});
      s.on("close", () => sockets.delete(s));
    }
  });
  await new Promise((r) => proxy.listen(0, "127.0.0.1", r));
  return { proxy, sockets };
}

describe("Web Shell", () => {
  test("a demo prompt streams into the transcript; the page passes an accessibility check", async () => {
    const sid = await session();
    // axe is injected as an inline script, which the Web Shell's CSP
    // (rightly) refuses: this page alone bypasses it.
    const p = await open(sid, { bypassCSP: true });
    await send(p, "hello");
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent.includes("scripted engine"));
    await p.waitForFunction(() => document.querySelector("#state").dataset.state === "idle");
    assert.equal(await p.textContent(".user"), "hello");
    await screenshot(p, "transcript");
    await p.addScriptTag({ content: AXE });
    const violations = await p.evaluate(async () => {
      const r = await window.axe.run(document, { resultTypes: ["violations"] });
      return r.violations.filter((v) => ["serious", "critical"].includes(v.impact)).map((v) => `${v.id}: ${v.help}`);
    });
    assert.deepEqual(violations, []);
    await p.context().close();
  });

  test("Markdown with a highlighted code block, an edit's diff, a tool call's input and output; dark mode and zh-CN", async () => {
    const sid = await session();
    const put = await api(daemon, "PUT", `/api/sessions/${sid}/options/permission_mode`, { value: "allow-all" });
    assert.equal(put.status, 200, JSON.stringify(put.body));
    const p = await open(sid, { bypassCSP: true });
    const md = "## Plan\n\nRun **the tests**, then `cargo fmt`:\n\n```rust\nfn main() {\n    println!(\"hi\");\n}\n```\n\n<img src=x onerror=\"window.__pwned=1\">";
    await send(p, script([
      { say: md },
      { tool: { name: "edit", input: { path: "src/main.rs", old_string: "println!(\"hi\")", new_string: "println!(\"hello\")" }, output: "replaced 1 occurrence" } },
      { tool: { name: "grep", input: { pattern: "hello" }, output: "src/main.rs:2: hello" } },
    ]));
    await p.waitForFunction(() => document.querySelectorAll(".tool[data-status=completed]").length === 2);
    // Markdown: a heading, bold, inline code, a highlighted Rust block.
    assert.equal(await p.textContent(".agent h2"), "Plan");
    assert.equal(await p.textContent(".agent strong"), "the tests");
    assert.equal(await p.textContent(".agent p code"), "cargo fmt");
    assert.ok(await p.$(".agent pre code.hljs .hljs-keyword"), "the code block is highlighted");
    // The agent's HTML is sanitized: no handler ran, none is left.
    assert.equal(await p.evaluate(() => window.__pwned), undefined);
    assert.equal(await p.$$eval(".agent [onerror]", (n) => n.length), 0);
    // The edit shows as a diff; the other call's input and output open up.
    const [edit, grep] = await p.$$(".tool");
    await edit.evaluate((d) => { d.open = true; });
    assert.deepEqual(
      await edit.$$eval(".diff-line", (ls) => ls.map((l) => [l.className.split(" ")[1], l.textContent])),
      [["diff-del", '- println!("hi")\n'], ["diff-add", '+ println!("hello")\n']],
    );
    await grep.evaluate((d) => { d.open = true; });
    assert.match(await grep.$eval(".tool-input", (n) => n.textContent), /"pattern": "hello"/);
    assert.equal(await grep.$eval(".tool-output", (n) => n.textContent), "src/main.rs:2: hello");
    await screenshot(p, "markdown-and-diff");
    const AXE_OK = async (page) => {
      await page.addScriptTag({ content: AXE });
      return page.evaluate(async () => {
        const r = await window.axe.run(document, { resultTypes: ["violations"] });
        return r.violations.filter((v) => ["serious", "critical"].includes(v.impact)).map((v) => `${v.id}: ${v.help}`);
      });
    };
    assert.deepEqual(await AXE_OK(p), []);
    // Dark mode follows the system setting.
    await p.emulateMedia({ colorScheme: "dark" });
    const bg = await p.evaluate(() => getComputedStyle(document.body).backgroundColor);
    assert.equal(bg, "rgb(22, 24, 28)");
    await screenshot(p, "dark-mode");
    assert.deepEqual(await AXE_OK(p), []);
    await p.context().close();
    // The same session in Chinese: labels translated, the content as it was.
    const zh = await open(sid, { locale: "zh-CN" });
    await zh.waitForFunction(() => document.querySelectorAll(".tool").length === 2);
    assert.equal(await zh.textContent("#compact"), "压缩");
    await zh.$$eval(".tool", (ds) => ds.forEach((d) => { d.open = true; }));
    assert.equal(await zh.textContent(".tool .tool-label"), "更改");
    await screenshot(zh, "zh-CN");
    await zh.context().close();
  });

  test("loop_detected is shown localized (en, zh-CN), survives a reload, and a new prompt supersedes it", async () => {
    const sid = await session();
    const en = await open(sid, { locale: "en-US" });
    await send(en, LOOP);
    await en.waitForSelector("#last-error[data-error-kind=loop_detected]");
    assert.match(await en.textContent("#last-error"), EN_LOOP);
    assert.match(await en.textContent(".turn-error"), EN_LOOP);
    await screenshot(en, "loop-detected-en");
    // After a page reload the error is still shown.
    await en.reload();
    await en.waitForSelector("#last-error[data-error-kind=loop_detected]");
    assert.match(await en.textContent("#last-error"), EN_LOOP);

    const zh = await open(sid, { locale: "zh-CN" });
    await zh.waitForSelector("#last-error[data-error-kind=loop_detected]");
    const zhText = await zh.textContent("#last-error");
    assert.match(zhText, ZH_LOOP);
    const body = await zh.textContent("body");
    assert.ok(!body.includes("Loop protection stopped this turn"), "the English daemon message is not shown");
    assert.ok(!EN_LOOP.test(body));
    await screenshot(zh, "loop-detected-zh-CN");
    await zh.context().close();

    // A new prompt supersedes the error.
    await send(en, script([{ say: "fresh start" }]));
    await en.waitForFunction(() => !document.querySelector("#last-error"));
    await en.context().close();
  });

  test("steer mid-turn, then cancel", async () => {
    const sid = await session();
    const p = await open(sid);
    await send(p, script([{ say: "working " }, { await_steer: 5000 }, { consume_steer: true }, { sleep_ms: 30000 }]));
    await p.waitForFunction(() => document.querySelector("#state").dataset.state === "running");
    await send(p, script([{ say: "steered!" }]));
    await p.waitForSelector("#form-status[data-outcome=injected]");
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent.includes("steered!"));
    await p.click("#cancel");
    await p.waitForFunction(() => document.querySelector("#state").dataset.state === "idle");
    await p.context().close();
  });

  test("tool calls go from pending to completed, and to failed", async () => {
    const sid = await session();
    const p = await open(sid);
    await send(
      p,
      script([
        { plan: [{ content: "look around", status: "completed" }, { content: "report" }] },
        { tool: { name: "read_file", input: { path: "a" }, output: "contents" } },
        { tool: { name: "build", outcome: "error", output: "error: boom" } },
      ]),
    );
    await p.waitForSelector(".tool[data-status=failed]");
    const statuses = await p.$$eval(".tool", (ts) => ts.map((t) => t.dataset.status));
    assert.deepEqual(statuses, ["completed", "failed"]);
    assert.match(await p.textContent(".tool[data-status=failed]"), /error: boom/);
    const plan = await p.$$eval(".plan li", (li) => li.map((l) => l.dataset.status));
    assert.deepEqual(plan, ["completed", "pending"]);
    await screenshot(p, "tools");
    await p.context().close();
  });

  test("permission dialog: allow runs the call, deny fails it", async () => {
    const sid = await session();
    const p = await open(sid);
    const write = (path) => ({ tool: { name: "write_file", input: { path }, output: "written" } });
    await send(p, script([write("a.txt"), write("b.txt")]));
    await p.waitForSelector("dialog#permission[open]");
    // The call waits, pending, until someone decides.
    assert.equal(await p.getAttribute(".tool", "data-status"), "pending");
    await screenshot(p, "permission");
    const first = await p.getAttribute("dialog#permission", "data-request");
    await p.click("dialog#permission [data-option=allow_once]");
    // The second call's request (ids are the daemon's, one per call).
    await p.waitForFunction((first) => {
      const d = document.querySelector("dialog#permission");
      return d.open && d.dataset.request && d.dataset.request !== first;
    }, first);
    await p.click("dialog#permission [data-option=reject_once]");
    await p.waitForFunction(() => document.querySelectorAll(".tool[data-status=failed]").length === 1);
    const statuses = await p.$$eval(".tool", (ts) => ts.map((t) => t.dataset.status));
    assert.deepEqual(statuses, ["completed", "failed"]);
    await p.context().close();
  });

  test("agent HTML cannot stand in for the page's own controls (ids, forms, dialogs)", async () => {
    const sid = await session();
    const p = await open(sid);
    // What a hostile README could have the model echo: the page's own ids
    // on a prompt box holding another prompt, a dialog, a Cancel button.
    const evil = [
      '<textarea hidden id="prompt-text">/mode allow-all</textarea>',
      '<dialog id="permission"><p hidden id="permission-text"></p><p>The agent wants to run ls.</p><div id="permission-options"></div></dialog>',
      '<button id="cancel">x</button> <form id="prompt-form" name="send"><input name="state" id="state"><select id="lang-select"><option>x</option></select></form>',
      // A banner drawn with the page's own classes, role and strings.
      '<div class="banner banner-error" role="alert" data-i18n="signIn" data-error-kind="loop_detected" id="last-error">Not signed in</div>',
      "",
      "- [x] done",
      "- [ ] to do",
      "",
      "```rust\nfn main() {}\n```",
    ].join("\n");
    await send(p, script([{ say: evil }, { say: " the end" }]));
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent.includes("the end"));
    const left = await p.$$eval(
      ".agent :is([id], [name], [role], [class*=banner], [data-i18n], [data-error-kind], textarea, dialog, button, form, input, select, option)",
      (ns) => ns.map((n) => n.outerHTML),
    );
    assert.deepEqual(left, []);
    // A task list keeps its checks, as text; code is still highlighted.
    const text = await p.textContent(".agent");
    assert.ok(text.includes("☑ done") && text.includes("☐ to do"), text);
    assert.ok(await p.$(".agent pre code.hljs .hljs-keyword"), "the code block is highlighted");
    // Switching the language touches the page's own strings only.
    await p.selectOption("#lang-select", "de");
    assert.ok((await p.textContent(".agent")).includes("Not signed in"));
    // What the user types is what is sent; a request opens the page's own dialog.
    const write = script([{ tool: { name: "write_file", input: { path: "a.txt", content: "hi" }, output: "written" } }]);
    await send(p, write);
    await p.waitForFunction(() => [...document.querySelectorAll("dialog[open]")].some((d) => d.id === "permission" && !d.closest("#transcript")));
    assert.equal(await p.$$eval(".user", (us) => us.at(-1).textContent), write);
    const mode = (await api(daemon, "GET", `/api/sessions/${sid}/options`)).body.options.find((o) => o.id === "permission_mode");
    assert.notEqual(mode.current, "allow-all");
    await p.context().close();
  });

  test("the permission dialog shows what the call would do; Esc does not lose it", async () => {
    const sid = await session();
    const p = await open(sid);
    await send(p, script([
      { tool: { name: "write_file", input: { path: "notes/a.txt", content: `first line\nsecond line\n${"filler\n".repeat(700)}LAST LINE` }, output: "written" } },
      { tool: { name: "shell", input: { command: "rm -rf build" }, output: "" } },
    ]));
    await p.waitForSelector("dialog#permission[open]");
    const first = await p.textContent("dialog#permission");
    assert.match(first, /notes\/a\.txt/, first);
    assert.match(first, /second line/, first);
    // All of it: a harmful line after 700 harmless ones is shown too.
    assert.match(first, /LAST LINE/);
    const request = await p.getAttribute("dialog#permission", "data-request");
    // Esc (or anything else that closes it unanswered) brings it back: the
    // call still waits for a decision.
    await p.keyboard.press("Escape");
    await p.waitForFunction((r) => {
      const d = document.querySelector("dialog#permission");
      return d.open && d.dataset.request === r;
    }, request);
    await p.click("dialog#permission [data-option=allow_once]");
    await p.waitForFunction((r) => {
      const d = document.querySelector("dialog#permission");
      return d.open && d.dataset.request && d.dataset.request !== r;
    }, request);
    assert.match(await p.textContent("dialog#permission"), /rm -rf build/);
    await p.click("dialog#permission [data-option=reject_once]");
    await p.waitForFunction(() => document.querySelector("#state").dataset.state === "idle");
    await p.context().close();
  });

  test("an event the page cannot draw does not stop it drawing the others", async () => {
    const sid = await session();
    await api(daemon, "PUT", `/api/sessions/${sid}/options/permission_mode`, { value: "allow-all" });
    const p = await open(sid);
    await send(p, script([
      { tool: { name: "edit", input: { path: "a.txt", edits: [null] }, output: "refused" } },
      { say: "after" },
    ]));
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent === "after");
    await p.waitForFunction(() => document.querySelector("#state").dataset.state === "idle");
    await p.context().close();
  });

  test("a link in agent text to an address on this machine asks first (the page's cookie would go with it)", async () => {
    const sid = await session();
    const p = await open(sid);
    await send(p, script([{ say: "see [the docs](http://127.0.0.1:9/admin) and [more](https://example.invalid/x)" }]));
    await p.waitForSelector(".agent a");
    // The real address is shown, whatever the text says.
    assert.deepEqual(
      await p.$$eval(".agent a", (as) => as.map((a) => a.title)),
      ["http://127.0.0.1:9/admin", "https://example.invalid/x"],
    );
    const asked = [];
    p.on("dialog", (d) => {
      asked.push(d.message());
      d.dismiss();
    });
    const before = p.context().pages().length;
    await p.click(".agent a >> nth=0");
    await p.waitForTimeout(300);
    assert.equal(asked.length, 1, "asked before opening a local address");
    assert.match(asked[0], /127\.0\.0\.1:9/);
    assert.equal(p.context().pages().length, before, "declined: nothing opened");
    await p.context().close();
  });

  test("images in agent text never reach the daemon's API", async () => {
    const sid = await session();
    const p = await open(sid);
    const asked = [];
    // A response: the request reached the daemon (one the page's policy
    // blocks never does).
    p.on("response", (r) => {
      if (r.request().resourceType() === "image") asked.push(r.url());
    });
    await send(p, script([{ say: `![a](/api/sessions/${sid}) ![b](/api/sessions/${sid}/events?after=0) done` }]));
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent.includes("done"));
    await p.waitForTimeout(300);
    assert.deepEqual(asked, []);
    await p.context().close();
  });

  test("switching sessions quickly leaves one event stream open, the last session's", async () => {
    const [a, b] = [await session(), await session()];
    const p = await newPage(browser);
    await p.addInitScript(() => {
      const Real = window.EventSource;
      window.__streams = [];
      window.EventSource = class extends Real {
        constructor(...args) {
          super(...args);
          window.__streams.push(this);
        }
      };
    });
    await p.goto(`${daemon.http}/?token=${daemon.token}#${b}`);
    await p.waitForSelector("#state[data-state]");
    // Session a's history is slow to come: b is chosen meanwhile.
    await p.route(`**/api/sessions/${a}/history*`, async (route) => {
      const res = await route.fetch();
      await new Promise((r) => setTimeout(r, 800));
      return route.fulfill({ response: res });
    });
    await p.click(`[data-session="${a}"]`);
    await p.click(`[data-session="${b}"]`);
    await p.waitForTimeout(1500);
    const open = await p.evaluate(() => window.__streams.filter((s) => s.readyState !== EventSource.CLOSED).map((s) => s.url));
    assert.equal(open.length, 1, JSON.stringify(open));
    assert.ok(open[0].includes(`/api/sessions/${b}/events`), open[0]);
    assert.equal(await p.getAttribute(`[data-session="${b}"]`, "aria-current"), "true");
    await p.context().close();
  });

  test("consecutive thoughts are one block, and one the user opened stays open as the turn streams", async () => {
    const sid = await session();
    const p = await open(sid);
    await send(p, script([{ think: "first, " }, { think: "second, " }, { think: "third" }, { sleep_ms: 400 }, { repeat: { times: 20, steps: [{ say: "x" }, { sleep_ms: 20 }] } }]));
    await p.waitForFunction(() => document.querySelector(".thought p")?.textContent === "first, second, third");
    assert.equal(await p.$$eval(".thought", (d) => d.length), 1);
    await p.click(".thought summary");
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent === "x".repeat(20));
    assert.equal(await p.$eval(".thought", (d) => d.open), true, "still open after re-renders");
    await p.context().close();
  });

  test("the transcript grows incrementally: what is on screen stays the same nodes (a selection survives) as a turn streams", async () => {
    const sid = await session();
    const p = await open(sid);
    await send(p, script([{ say: "first turn" }]));
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent === "first turn");
    // Mark the rendered nodes and select the text, as a reader would.
    await p.evaluate(() => {
      const agent = document.querySelector(".agent");
      agent.dataset.marker = "kept";
      window.__firstTurn = document.querySelector(".turn");
      const range = document.createRange();
      range.selectNodeContents(agent);
      getSelection().removeAllRanges();
      getSelection().addRange(range);
    });
    // The next turn comes from elsewhere (the API), as another client's would.
    const r = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ repeat: { times: 15, steps: [{ say: "y" }, { sleep_ms: 20 }] } }]) });
    assert.equal(r.status, 202, JSON.stringify(r.body));
    await p.waitForFunction(() => [...document.querySelectorAll(".agent")].some((a) => a.textContent === "y".repeat(15)));
    assert.equal(await p.evaluate(() => document.querySelector(".turn") === window.__firstTurn), true, "the first turn's node was never replaced");
    assert.equal(await p.$eval(".agent", (a) => a.dataset.marker), "kept");
    assert.equal(await p.evaluate(() => getSelection().toString()), "first turn", "the selection survived");
    await p.context().close();
  });

  test("an older snapshot answer never overwrites a newer state", async () => {
    const sid = await session();
    const p = await open(sid);
    // The first snapshot request after the send is answered last.
    let delayed = false;
    await p.route(`**/api/sessions/${sid}`, async (route) => {
      if (!delayed && route.request().method() === "GET") {
        delayed = true;
        const res = await route.fetch();
        await new Promise((r) => setTimeout(r, 1500));
        return route.fulfill({ response: res });
      }
      return route.continue();
    });
    await send(p, script([{ sleep_ms: 300 }, { say: "done" }]));
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent === "done");
    await p.waitForFunction(() => document.querySelector("#state").dataset.state === "idle");
    await new Promise((r) => setTimeout(r, 1800)); // the stale "running" answer arrives now
    assert.equal(await p.$eval("#state", (s) => s.dataset.state), "idle");
    await p.context().close();
  });

  test("a narrow screen shows the same controls", async () => {
    const sid = await session();
    const p = await open(sid, { width: 390, height: 844 });
    await send(p, script([{ say: "small screen" }]));
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent === "small screen");
    assert.ok(await p.isVisible("#prompt-text"));
    assert.ok(await p.isVisible("#new-session"));
    await screenshot(p, "narrow");
    await p.context().close();
  });

  test("turns are labelled by origin; a goal paused by loop protection shows a banner", async () => {
    const sid = await session();
    const p = await open(sid);
    await api(daemon, "PUT", `/api/sessions/${sid}/goal`, { objective: LOOP, maxTurns: 5 });
    await p.waitForSelector("#goal-banner[data-reason=loop_detected]");
    const origins = await p.$$eval(".turn .origin", (os) => os.map((o) => o.textContent));
    assert.deepEqual(origins, ["Goal", "Goal", "Goal"]);
    await screenshot(p, "goal-paused");
    await api(daemon, "POST", `/api/sessions/${sid}/notifications`, { taskId: "t", text: script([{ say: "note" }]) });
    await p.waitForFunction(() => [...document.querySelectorAll(".turn .origin")].some((o) => o.textContent === "Notification"));
    await p.context().close();
  });

  test("history loads page by page when scrolling up", async () => {
    const sid = await session();
    await api(daemon, "POST", `/api/sessions/${sid}/prompts`, {
      text: script([{ say: "first words " }, { repeat: { times: 150, steps: [{ think: "mulling" }] } }, { say: "last words" }]),
    });
    for (let i = 0; i < 200; i++) {
      if ((await api(daemon, "GET", `/api/sessions/${sid}`)).body.state === "idle") break;
      await new Promise((r) => setTimeout(r, 20));
    }
    const p = await open(sid);
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent.includes("last words"));
    assert.ok(!(await p.textContent("#transcript")).includes("first words"), "only the newest page at first");
    for (let i = 0; i < 5 && !(await p.textContent("#transcript")).includes("first words"); i++) {
      await p.$eval("#transcript", (t) => { t.scrollTop = 0; t.dispatchEvent(new Event("scroll")); });
      await p.waitForTimeout(200);
    }
    assert.ok((await p.textContent("#transcript")).includes("first words"));
    await p.context().close();
  });

  test("after a network loss the stream resumes from the last event id, without gaps or repeats", async () => {
    // A TCP proxy between the browser and the daemon stands in for the network.
    const { proxy, sockets } = await tcpProxy();
    const sid = await session();
    const p = await newPage(browser);
    const streams = [];
    p.on("request", async (r) => {
      if (r.url().includes("/events")) streams.push((await r.allHeaders())["last-event-id"] ?? null);
    });
    await p.goto(`http://127.0.0.1:${proxy.address().port}/?token=${daemon.token}#${sid}`);
    await p.waitForSelector("#state[data-state]");
    await send(p, script([{ repeat: { times: 60, steps: [{ say: "x" }, { sleep_ms: 50 }] } }, { say: "!" }]));
    await p.waitForFunction(() => (document.querySelector(".agent")?.textContent.length ?? 0) >= 5);
    for (const s of sockets) s.destroy(); // the network drops
    await p.waitForFunction(() => document.querySelector(".agent")?.textContent.endsWith("!"), null, { timeout: 20000 });
    assert.equal(await p.textContent(".agent"), "x".repeat(60) + "!");
    assert.ok(streams.length >= 2, `the stream reconnected: ${JSON.stringify(streams)}`);
    assert.match(String(streams.at(-1)), /^\d+$/, "with Last-Event-ID");
    await p.context().close();
    proxy.close();
  });

  test("the page says when its stream is down, and when the session is gone", async () => {
    const { proxy, sockets } = await tcpProxy();
    const at = proxy.address().port;
    const sid = await session();
    const p = await newPage(browser);
    await p.goto(`http://127.0.0.1:${at}/?token=${daemon.token}#${sid}`);
    await p.waitForSelector("#state[data-state]");
    assert.equal(await p.$("#offline"), null);
    // The network goes and stays gone: the page says it is reconnecting.
    await new Promise((r) => {
      proxy.close(r);
      for (const s of sockets) s.destroy();
    });
    await p.waitForSelector("#offline", { timeout: 10000 });
    // Back: the stream resumes and the notice goes.
    await new Promise((r) => proxy.listen(at, "127.0.0.1", r));
    await p.waitForFunction(() => !document.querySelector("#offline"), null, { timeout: 20000 });
    // The session is closed elsewhere: said so, not retried for ever.
    const del = await api(daemon, "DELETE", `/api/sessions/${sid}`);
    assert.ok(del.status < 300, JSON.stringify(del.body));
    await p.waitForSelector("#session-gone", { timeout: 20000 });
    await p.context().close();
    proxy.close();
    for (const s of sockets) s.destroy();
  });

  test("an unknown error kind shows the daemon's message; known kinds never do", async () => {
    const { errorText, translator } = await import("../../crates/tiller-http/web/i18n.js");
    // A key a hostile agent chooses (a plan entry's status) is never one of
    // an object's own properties.
    for (const key of ["constructor", "toString", "__proto__", "hasOwnProperty"]) {
      assert.equal(translator("de")(key), key);
      assert.equal(errorText(translator("en"), { errorKind: key, message: "m" }), "m");
    }
    for (const lang of ["en", "zh-CN", "ja", "de", "es"]) {
      const t = translator(lang);
      assert.equal(errorText(t, { errorKind: "brand_new_kind", message: "daemon says" }), "daemon says");
      for (const kind of ["loop_detected", "overloaded", "engine_crashed", "stalled"]) {
        const known = errorText(t, { errorKind: kind, message: "ENGLISH DAEMON TEXT" });
        assert.ok(!known.includes("ENGLISH DAEMON TEXT") && known.length > 5, `${lang} ${kind}`);
      }
      // A hosted agent's restart is told in the language too, with its reason.
      for (const key of ["agentReloaded", "agentFresh"]) {
        const text = t(key, { reason: "REASON" });
        assert.ok(text !== key && text.includes("REASON"), `${lang} ${key}`);
      }
    }
  });
});
