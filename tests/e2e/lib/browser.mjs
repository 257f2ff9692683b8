// Headless Chromium (Debian's, at /usr/bin/chromium) driven by playwright-core.

import { mkdirSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
export const artifacts = path.resolve(here, "../artifacts");

export async function launch() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
}

/** A page with the given browser language preferences. */
export async function page(browser, { locale = "en-US", width = 1200, height = 800, bypassCSP = false } = {}) {
  const context = await browser.newContext({ locale, viewport: { width, height }, bypassCSP });
  return context.newPage();
}

export async function screenshot(p, name) {
  mkdirSync(artifacts, { recursive: true });
  await p.screenshot({ path: path.join(artifacts, `${name}.png`), fullPage: true });
}
