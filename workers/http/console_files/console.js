// The queue-node console: polls this node's JSON endpoints every 2 s and draws them.
//
// Plain JavaScript, no build step, nothing from another origin (the page's
// Content-Security-Policy allows only this node). Every value is drawn with
// textContent, never as HTML: keys and error messages come from users.
//
// Endpoints read: /healthz (the node's name, once), /queue-state, /accounting,
// /leases, /held. Endpoints posted: /admin/unhold, /admin/pause, /admin/resume.
// The fleet view is fleet.js, which uses the helpers this file shares
// (window.QueueNodeConsole, at the end).
// Every request, read or post, carries "Authorization: Bearer <token>" once
// the operator has pasted a token (kept in sessionStorage: this tab only,
// gone when it closes): a node with a token answers only /healthz, /readyz,
// /metrics and these files without it, and the page says so.
"use strict";

(function () {
  const REFRESH_MS = 2000;
  const TOKEN_KEY = "queue-node-token";
  const LIST_LIMIT = 200;
  // shm/state.py: the keeper vouches only for counts younger than 15 s and a
  // heartbeat younger than 5 s.
  const COUNTS_MAX_AGE_S = 15;
  const HEARTBEAT_MAX_AGE_S = 5;
  // Parked keys "pile up" when there are more now than this long ago.
  const PARKED_WINDOW_MS = 60000;

  const parkedHistory = []; // [[ms, parked], ...], oldest first
  let heldSignature = "";
  let lastAccounting = null;

  // -- small helpers -----------------------------------------------------------------

  function byId(id) {
    return document.getElementById(id);
  }

  function fmt(value) {
    if (value === null || value === undefined) {
      return "–";
    }
    if (typeof value === "number") {
      return Number.isInteger(value) ? value.toLocaleString("en-US") : value.toFixed(3);
    }
    if (typeof value === "boolean") {
      return value ? "yes" : "no";
    }
    if (typeof value === "object") {
      return JSON.stringify(value);
    }
    return String(value);
  }

  function setText(id, value) {
    const el = byId(id);
    if (el) {
      el.textContent = fmt(value);
    }
  }

  function clock(unixSeconds) {
    if (typeof unixSeconds !== "number" || unixSeconds <= 0) {
      return "–";
    }
    return new Date(unixSeconds * 1000).toLocaleTimeString("en-GB");
  }

  function duration(seconds) {
    if (typeof seconds !== "number") {
      return "–";
    }
    const abs = Math.abs(seconds);
    let text;
    if (abs < 120) {
      text = abs.toFixed(1) + " s";
    } else if (abs < 7200) {
      text = (abs / 60).toFixed(1) + " min";
    } else if (abs < 172800) {
      text = (abs / 3600).toFixed(1) + " h";
    } else {
      text = (abs / 86400).toFixed(1) + " d";
    }
    return seconds < 0 ? "−" + text : text;
  }

  function cell(row, value, className) {
    const td = document.createElement("td");
    td.textContent = fmt(value);
    if (className) {
      td.className = className;
    }
    row.appendChild(td);
    return td;
  }

  function tbody(tableId) {
    const body = byId(tableId).querySelector("tbody");
    body.replaceChildren();
    return body;
  }

  function bars(id, values) {
    const box = byId(id);
    box.replaceChildren();
    const top = Math.max(1, ...values);
    for (const value of values) {
      const bar = document.createElement("div");
      // CSSOM, not a style attribute: allowed by the page's CSP.
      bar.style.height = Math.round((100 * value) / top) + "%";
      bar.title = String(value);
      box.appendChild(bar);
    }
  }

  // -- HTTP --------------------------------------------------------------------------

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  function headers(extra) {
    const out = Object.assign({ Accept: "application/json" }, extra || {});
    if (token()) {
      out.Authorization = "Bearer " + token();
    }
    return out;
  }

  // {status, body}; throws only when the node cannot be reached.
  async function getJson(path) {
    const response = await fetch(path, { headers: headers(), cache: "no-store" });
    let body = null;
    try {
      body = await response.json();
    } catch (err) {
      body = null;
    }
    return { status: response.status, body: body };
  }

  function errorText(answer) {
    const error = answer.body && answer.body.error;
    return error ? error.code + ": " + error.message : "HTTP " + answer.status;
  }

  // Posts payload; the outcome is written to the element messageId (the
  // page's action line by default). Resolves to the answer's body on a 200,
  // to null otherwise.
  async function post(path, payload, done, messageId) {
    const message = byId(messageId || "action-message");
    message.className = "";
    message.textContent = "…";
    let answer;
    try {
      const response = await fetch(path, {
        method: "POST",
        headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(payload),
      });
      let body = null;
      try {
        body = await response.json();
      } catch (err) {
        body = null;
      }
      answer = { status: response.status, body: body };
    } catch (err) {
      message.className = "bad";
      message.textContent = path + ": the node does not answer (" + err.message + ")";
      return null;
    }
    if (answer.status === 401) {
      message.className = "bad";
      message.textContent = "This node needs its token for " + path + ": paste it above.";
    } else if (answer.status !== 200) {
      message.className = "bad";
      message.textContent = path + " refused: " + errorText(answer);
    } else {
      message.className = "ok";
      message.textContent = done(answer.body);
    }
    refresh();
    return answer.status === 200 ? answer.body : null;
  }

  // -- the groups --------------------------------------------------------------------

  function pausedText(paused) {
    if (!paused) {
      return "–";
    }
    const parts = [];
    if (paused.node) {
      parts.push("the whole node");
    }
    if (paused.routes && paused.routes.length) {
      parts.push("routes " + paused.routes.join(", "));
    }
    return parts.length ? parts.join("; ") : "no";
  }

  function renderNow(now) {
    const due = now.due || {};
    setText("due-total", due.total);
    setText("due-sitemap", due.sitemap);
    setText("due-discovered", due.discovered);
    setText("now-unclaimed", now.unclaimed);
    setText("now-held", now.held);
    setText("now-parked", now.parked);
  }

  function renderLive(now) {
    // What a 503 still carries: the lease table and the pause settings are live.
    setText("now-in-flight", now.in_flight);
    byId("paused-state").textContent = pausedText(now.paused);
    setText("node-status", now.status);
  }

  function renderComing(coming) {
    setText("coming-15m", coming["15m"]);
    setText("coming-60m", coming["60m"]);
    setText("coming-24h", coming["24h"]);
    bars("coming-bars", coming.by_hour || []);
  }

  function renderLateness(lateness) {
    const labels = lateness.labels || [];
    const head = byId("lateness-bins").querySelector("thead tr");
    head.replaceChildren();
    for (const text of ["kind"].concat(labels)) {
      const th = document.createElement("th");
      th.textContent = text;
      head.appendChild(th);
    }
    const body = tbody("lateness-bins");
    const rows = [["sitemap", lateness.sitemap], ["discovered", lateness.discovered],
      ["total", lateness.total]];
    for (const [route, counts] of Object.entries(lateness.by_route || {})) {
      rows.push(["route " + route, counts]);
    }
    for (const [name, counts] of rows) {
      const tr = document.createElement("tr");
      cell(tr, name);
      for (let i = 0; i < labels.length; i++) {
        cell(tr, counts ? counts[i] : null);
      }
      body.appendChild(tr);
    }
    const oldest = tbody("lateness-oldest");
    for (const item of lateness.oldest || []) {
      const tr = document.createElement("tr");
      cell(tr, item.route);
      cell(tr, item.source);
      cell(tr, item.sitemap);
      cell(tr, item.due);
      cell(tr, duration(item.cadence_s));
      cell(tr, duration(item.lateness_s));
      cell(tr, item.lateness_ratio, item.lateness_ratio > 1 ? "error" : "");
      oldest.appendChild(tr);
    }
  }

  const FLOW_MINUTES = 60;
  const FLOW_KEYS = ["came_due", "added", "updated", "triggered", "rescheduled", "removed"];

  function renderFlow(flow) {
    const body = tbody("flow-last-hour");
    const tr = document.createElement("tr");
    const sums = flow.last_hour || {};
    for (const key of FLOW_KEYS) {
      cell(tr, sums[key]);
    }
    body.appendChild(tr);
    // One bar per minute of the last hour, the newest on the right.
    const triggered = (flow.minutes || []).map((m) => m.triggered || 0).slice(-FLOW_MINUTES);
    bars("flow-bars", new Array(FLOW_MINUTES - triggered.length).fill(0).concat(triggered));
  }

  // The classes group: a list, or {"rows": [...], "truncated": bool}.
  function classList(classes) {
    if (classes && !Array.isArray(classes)) {
      return classes.rows || [];
    }
    return classes || [];
  }

  function renderClasses(classes) {
    const body = tbody("classes-table");
    for (const c of classList(classes)) {
      const tr = document.createElement("tr");
      cell(tr, c.route);
      cell(tr, c.source);
      cell(tr, c.sitemap);
      cell(tr, duration(c.cadence_s));
      cell(tr, c.boost);
      cell(tr, c.rows);
      cell(tr, c.due);
      cell(tr, c.oldest_lateness_ratio);
      body.appendChild(tr);
    }
  }

  function renderTrust(trust) {
    const repairs = (trust || {}).repairs;
    setText("ledger-repairs", repairs ? (repairs.total || 0) + (repairs.top || 0) : "–");
    const list = byId("trust");
    list.replaceChildren();
    for (const [key, value] of Object.entries(trust || {})) {
      const dt = document.createElement("dt");
      dt.textContent = key;
      const dd = document.createElement("dd");
      // Wall times ("counts_at", "last_at") as clock times; the rest as given.
      dd.textContent = key.endsWith("_at") && typeof value === "number" ? clock(value) : fmt(value);
      list.append(dt, dd);
    }
  }

  function ledgerGap(acc) {
    return acc.routed - acc.finished - acc.expired - acc.released - acc.in_flight;
  }

  function inputSide(gaps) {
    if (gaps.input === null || gaps.input === undefined) return " (input side unknown: no keeper counts)";
    if (gaps.input !== 0) return " (input side off by " + gaps.input + ")";
    return "";
  }

  function renderLedger(acc) {
    const badge = byId("ledger-balanced");
    if (!acc) {
      badge.textContent = "unavailable";
      badge.className = "badge bad";
      return;
    }
    for (const key of ["received", "routed", "finished", "acknowledged", "expired",
      "released", "refused", "requeued", "waiting", "withdrawn", "discarded"]) {
      setText("ledger-" + key, acc[key] === null || acc[key] === undefined ? "–" : acc[key]);
    }
    setText("ledger-in-flight", acc.in_flight);
    setText("ledger-awaiting-ack", acc.awaiting_ack);
    setText("ledger-gap", ledgerGap(acc));
    const gaps = acc.gaps || {};
    setText("ledger-input-gap", gaps.input === null || gaps.input === undefined ? "unknown" : gaps.input);
    badge.textContent = acc.balanced ? "balanced" : "NOT balanced" + inputSide(gaps);
    badge.className = "badge " + (acc.balanced ? "ok" : "bad");
  }

  function renderLeases(leases) {
    const body = tbody("leases-table");
    const nowS = Date.now() / 1000;
    for (const lease of leases) {
      const tr = document.createElement("tr");
      tr.dataset.key = lease.key;
      tr.dataset.testid = "lease-row";
      cell(tr, lease.key, "key");
      cell(tr, lease.consumer);
      cell(tr, String(lease.lease_id));
      cell(tr, clock(lease.granted_at));
      cell(tr, duration(lease.expires_at - nowS));
      body.appendChild(tr);
    }
    byId("leases-count").textContent = "(" + leases.length + " shown)";
  }

  function unhold(key) {
    post("/admin/unhold", { keys: [key] }, (body) =>
      body.unheld ? "Unheld " + key + "." : key + " was not held any more.");
  }

  function renderHeld(held) {
    // Redrawn only when something changed, so a button is not replaced under
    // the operator's click.
    const signature = JSON.stringify(held);
    if (signature === heldSignature) {
      return;
    }
    heldSignature = signature;
    const body = tbody("held-table");
    for (const hold of held) {
      const tr = document.createElement("tr");
      tr.dataset.key = hold.key;
      tr.dataset.testid = "held-row";
      tr.dataset.parked = hold.parked ? "true" : "false";
      cell(tr, hold.key, "key");
      cell(tr, hold.parked ? "parked" : "held");
      cell(tr, hold.misses);
      cell(tr, hold.parked ? "until unhold or a new write" : clock(hold.held_until));
      cell(tr, hold.last_error || "", "error");
      const td = cell(tr, null);
      td.textContent = "";
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = "Unhold";
      button.dataset.testid = "unhold";
      button.addEventListener("click", () => unhold(hold.key));
      td.appendChild(button);
      body.appendChild(tr);
    }
    const parked = held.filter((h) => h.parked).length;
    byId("held-count").textContent = "(" + parked + " parked, " + (held.length - parked)
      + " held" + (held.length >= LIST_LIMIT ? ", first " + LIST_LIMIT + " shown" : "") + ")";
  }

  // -- health checks -----------------------------------------------------------------

  function setCheck(name, level, detail) {
    const li = document.querySelector('#checks li[data-check="' + name + '"]');
    li.className = level;
    li.dataset.level = level;
    li.querySelector(".detail").textContent = detail ? "— " + detail : "";
  }

  function checkFresh(trust) {
    const counts = trust.state_age_s;
    const beat = trust.heartbeat_age_s;
    if (typeof counts !== "number" || typeof beat !== "number") {
      setCheck("fresh", "unknown", "no state written yet");
    } else if (counts < COUNTS_MAX_AGE_S && beat < HEARTBEAT_MAX_AGE_S) {
      setCheck("fresh", "ok", "counts " + counts.toFixed(1) + " s, heartbeat "
        + beat.toFixed(1) + " s old");
    } else {
      setCheck("fresh", "fail", "counts " + counts.toFixed(1) + " s, heartbeat "
        + beat.toFixed(1) + " s old");
    }
  }

  function checkParked(parked) {
    if (typeof parked !== "number") {
      setCheck("parked", "unknown", "not counted");
      return;
    }
    const nowMs = Date.now();
    parkedHistory.push([nowMs, parked]);
    while (parkedHistory.length > 1 && parkedHistory[1][0] <= nowMs - PARKED_WINDOW_MS) {
      parkedHistory.shift();
    }
    const before = parkedHistory[0][1];
    if (parked === 0) {
      setCheck("parked", "ok", "none parked");
    } else if (parked > before) {
      setCheck("parked", "fail", parked + " parked, up " + (parked - before)
        + " in the last minute");
    } else {
      setCheck("parked", "warn", parked + " parked, not rising");
    }
  }

  function checkLateness(state) {
    const lateness = state.lateness || {};
    const ratios = (lateness.oldest || []).map((o) => o.lateness_ratio)
      .concat(classList(state.classes).map((c) => c.oldest_lateness_ratio))
      .filter((r) => typeof r === "number");
    if (!ratios.length) {
      setCheck("lateness", "ok", "nothing due");
      return;
    }
    const worst = Math.max(...ratios);
    const text = "oldest at " + worst.toFixed(2) + " cadences";
    setCheck("lateness", worst <= 1 ? "ok" : "fail", text);
  }

  function checkLedger(acc) {
    if (!acc) {
      setCheck("balanced", "unknown", "GET /accounting did not answer");
    } else if (acc.balanced) {
      setCheck("balanced", "ok", "");
    } else {
      setCheck("balanced", "fail", "routed − finished − expired − released − in flight = "
        + ledgerGap(acc));
    }
  }

  // -- one refresh -------------------------------------------------------------------

  function showVouched(state) {
    document.body.classList.remove("unvouched");
    byId("unvouched-banner").hidden = true;
    renderNow(state.now || {});
    renderLive(state.now || {});
    setText("counts-at", clock((state.now || {}).at));
    if (state.coming) {
      renderComing(state.coming);
    }
    if (state.lateness) {
      renderLateness(state.lateness);
    }
    if (state.flow) {
      renderFlow(state.flow);
    }
    renderClasses(state.classes);
    renderTrust(state.trust);
    setCheck("vouched", "ok", "");
    checkFresh(state.trust || {});
    checkParked((state.now || {}).parked);
    checkLateness(state);
  }

  function showUnvouched(answer) {
    const body = answer.body || {};
    const trust = body.trust || {};
    let reason = trust.reason;
    if (answer.status !== 503) {
      reason = "GET /queue-state answered " + errorText(answer);
    }
    document.body.classList.add("unvouched");
    byId("unvouched-banner").hidden = false;
    byId("unvouched-reason").textContent = reason ? "(" + reason + ")" : "";
    if (body.now) {
      renderLive(body.now);
    }
    renderTrust(trust);
    setCheck("vouched", "fail", reason || "");
    checkFresh(trust);
    setCheck("parked", "unknown", "the keeper cannot vouch");
    setCheck("lateness", "unknown", "the keeper cannot vouch");
  }

  // A node with a token refuses every read without it: say so, show nothing.
  function showNeedsToken() {
    byId("token-banner").hidden = false;
    document.body.classList.add("needs-token");
    setCheck("vouched", "unknown", "no token");
  }

  async function refresh() {
    let state;
    try {
      [state] = await Promise.all([
        getJson("/queue-state"),
        getJson("/accounting").then((a) => {
          lastAccounting = a.status === 200 ? a.body : null;
        }),
        getJson("/leases?limit=" + LIST_LIMIT).then((a) => {
          renderLeases(a.status === 200 ? a.body.leases : []);
        }),
        getJson("/held?limit=" + LIST_LIMIT).then((a) => {
          renderHeld(a.status === 200 ? a.body.held : []);
        }),
      ]);
    } catch (err) {
      document.body.classList.add("unreachable");
      byId("unreachable-banner").hidden = false;
      byId("unreachable-reason").textContent = err.message;
      return;
    }
    document.body.classList.remove("unreachable");
    byId("unreachable-banner").hidden = true;
    if (state.status === 401) {
      showNeedsToken();
      return;
    }
    byId("token-banner").hidden = true;
    document.body.classList.remove("needs-token");
    if (state.status === 200 && state.body && state.body.trust && state.body.trust.vouched !== false) {
      showVouched(state.body);
    } else {
      showUnvouched(state);
    }
    renderLedger(lastAccounting);
    checkLedger(lastAccounting);
    byId("refreshed-at").textContent = new Date().toLocaleTimeString("en-GB");
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  }

  async function loop() {
    await refresh();
    setTimeout(loop, REFRESH_MS);
  }

  // -- wiring ------------------------------------------------------------------------

  function showToken() {
    byId("token-state").textContent = token() ? "token set for this tab" : "no token";
  }

  function pauseAction(verb, route) {
    const payload = route ? { route: route } : {};
    const what = route ? "route " + route : "the node";
    post("/admin/" + verb, payload, () => (verb === "pause" ? "Paused " : "Resumed ") + what + ".");
  }

  function routeInput() {
    const route = byId("pause-route").value.trim();
    if (!route) {
      byId("action-message").className = "bad";
      byId("action-message").textContent = "Name the route first.";
    }
    return route;
  }

  async function start() {
    byId("token-save").addEventListener("click", () => {
      const value = byId("token-input").value.trim();
      if (value) {
        sessionStorage.setItem(TOKEN_KEY, value);
      }
      byId("token-input").value = "";
      showToken();
      refresh(); // the reads it unlocks, now rather than at the next tick
    });
    byId("token-clear").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      showToken();
      refresh();
    });
    byId("pause-node").addEventListener("click", () => pauseAction("pause", null));
    byId("resume-node").addEventListener("click", () => pauseAction("resume", null));
    byId("pause-route-btn").addEventListener("click", () => {
      const route = routeInput();
      if (route) {
        pauseAction("pause", route);
      }
    });
    byId("resume-route-btn").addEventListener("click", () => {
      const route = routeInput();
      if (route) {
        pauseAction("resume", route);
      }
    });
    showToken();
    try {
      const health = await getJson("/healthz");
      if (health.body && health.body.name) {
        byId("node-name").textContent = health.body.name;
        document.title = "queue-node " + health.body.name;
      }
    } catch (err) {
      // The refresh loop shows the node as unreachable.
    }
    loop();
  }

  // What fleet.js (the fleet view) shares with this page: the same token,
  // the same way to read and post, the same way to draw a value.
  window.QueueNodeConsole = {
    byId: byId, fmt: fmt, cell: cell, tbody: tbody, getJson: getJson, post: post,
    errorText: errorText,
  };

  document.addEventListener("DOMContentLoaded", start);
})();
