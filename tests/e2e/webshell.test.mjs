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
  await p.goto(`${daemon.http}/#${sid}`);
  await p.waitForSelector("#state[data-state]");
  return p;
}

async function send(p, text) {
  await p.fill("#prompt-text", text);
  await p.click("#send");
}

describe("Web Shell", () => {
  test("a demo prompt streams into the transcript; the page passes an accessibility check", async () => {
    const sid = await session();
    const p = await open(sid);
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
        { tool: { name: "read_file", input: { path: "a" }, output: "contents" } },
        { tool: { name: "build", outcome: "error", output: "error: boom" } },
      ]),
    );
    await p.waitForSelector(".tool[data-status=failed]");
    const statuses = await p.$$eval(".tool", (ts) => ts.map((t) => t.dataset.status));
    assert.deepEqual(statuses, ["completed", "failed"]);
    assert.match(await p.textContent(".tool[data-status=failed]"), /error: boom/);
    await screenshot(p, "tools");
    await p.context().close();
  });

  test("permission dialog: allow runs the call, deny fails it", async () => {
    const sid = await session();
    const p = await open(sid);
    const write = (path) => ({ tool: { name: "write_file", input: { path }, output: "written" } });
    await send(p, script([write("a.txt"), write("b.txt")]));
    await p.waitForSelector("dialog#permission[open]");
    await screenshot(p, "permission");
    await p.click("dialog#permission [data-option=allow_once]");
    await p.waitForFunction(() => {
      const d = document.querySelector("dialog#permission");
      return d.open && d.dataset.request?.endsWith("-2");
    });
    await p.click("dialog#permission [data-option=reject_once]");
    await p.waitForFunction(() => document.querySelectorAll(".tool[data-status=failed]").length === 1);
    const statuses = await p.$$eval(".tool", (ts) => ts.map((t) => t.dataset.status));
    assert.deepEqual(statuses, ["completed", "failed"]);
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
});
