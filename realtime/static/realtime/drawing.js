// The drawing page: a canvas sent as frames over /ws/session/, the worker's output shown beside it.
// Plain JS, no build step. The wire messages are those of docs/protocol.md, "Browser socket".
"use strict";

(function () {
  const root = document.getElementById("drawing");
  const $ = (id) => document.getElementById(id);
  const canvas = $("canvas");
  const ctx = canvas.getContext("2d");
  const output = $("output");
  const statusLine = $("status");
  const modelSelect = $("model");
  const prompt = $("prompt");
  const strength = $("strength");
  const colour = $("colour");
  const size = $("size");
  const meter = $("meter");
  const save = $("save");
  const sessionLimit = Number(root.dataset.sessionLimit || "0");

  const IN_FLIGHT_TIMEOUT_MS = 3000; // send the next frame anyway if a result never comes
  const BACKOFF_FIRST_MS = 500;
  const BACKOFF_MAX_MS = 15000;
  const LIMIT_RETRY_MS = 5000; // at the account's limit: try again this often (a session may end elsewhere)
  const RELEASED_RETRY_MS = 300; // another tab of this browser ended its session: try again this soon
  const METER_WINDOW_MS = 5000; // frames per second over the results shown in this window
  const ACCOUNT_LIMIT = 4003;
  // Close codes after which reconnecting cannot help: say why and stay closed.
  const FINAL_CLOSES = {
    4000: "This page asked for something the server does not accept. Reload the page.",
    4001: "You are logged out. Log in again to go on drawing.",
    4004: "No drawing model fits this request.",
    1000: "The session was ended.",
  };
  const OTHER_CLOSES = {
    4009: "A frame was too large to send.",
    4010: "The session was lost.", // taken for gone while this page held it: join again
  };
  // Tabs of this browser tell each other when one ends its session, so one waiting at the account's
  // limit starts at once instead of at its next retry.
  const tabs = "BroadcastChannel" in window ? new BroadcastChannel("potocolom-drawing") : null;

  let socket = null;
  let seq = 0; // the last frame number sent (numbers keep growing across reconnects)
  let shownSeq = -1; // the newest result shown; older ones are dropped
  let inFlight = null; // {seq, timer} of the frame awaiting its result
  let dirty = false; // the canvas or the params changed since the last frame sent
  let drawn = false; // something was drawn: a new socket gets the current canvas at once
  // Started afresh only when the session goes live again (reconnect.js); a socket that is accepted,
  // even told it is queued, and then dropped keeps backing off.
  const backoff = window.potocolomReconnect.Backoff(BACKOFF_FIRST_MS, BACKOFF_MAX_MS);
  let retryTimer = null;
  let atLimit = false; // the last socket was closed with 4003: waiting for a session of this account to end
  const sentAt = new Map(); // seq -> when it was sent (the newest few): a result's latency
  const shownAt = []; // when results were shown, within METER_WINDOW_MS
  let lastLatencyMs = null;

  // --- status line -------------------------------------------------------------------------

  function setStatus(text, kind) {
    statusLine.textContent = text;
    statusLine.className = "status " + (kind || "");
  }

  // The session's state in words (docs/protocol.md, "Browser socket": queued, live, idle).
  function stateText(message) {
    if (message.state === "queued") {
      return "Waiting for a free GPU: you are number " + message.position + " in line.";
    }
    if (message.state === "live") return "Live: " + message.model_id + " repaints your drawing as you draw.";
    if (message.state === "idle") return "Paused after a quiet spell: draw to carry on.";
    return null;
  }

  function limitText() {
    const many = sessionLimit === 1 ? "a drawing session" : sessionLimit + " drawing sessions";
    return "You already have " + many + " open (the most your account may have). " +
      "This page starts by itself when one of them closes.";
  }

  // --- frame latency and frames per second ----------------------------------------------------

  function showMeter() {
    const now = performance.now();
    while (shownAt.length && shownAt[0] < now - METER_WINDOW_MS) shownAt.shift();
    if (lastLatencyMs === null) {
      meter.textContent = "";
      return;
    }
    const span = shownAt.length > 1 ? (shownAt[shownAt.length - 1] - shownAt[0]) / 1000 : 0;
    const fps = span > 0 ? (shownAt.length - 1) / span : 0;
    meter.textContent = Math.round(lastLatencyMs) + " ms a frame · " + fps.toFixed(1) + " frames/s";
  }

  // --- canvas ------------------------------------------------------------------------------

  function clearCanvas() {
    ctx.save();
    ctx.globalCompositeOperation = "source-over";
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.restore();
  }

  function tool() {
    return document.querySelector('input[name="tool"]:checked').value;
  }

  // The canvas is shown larger than its pixels: map a pointer to canvas pixels.
  function point(event) {
    const box = canvas.getBoundingClientRect();
    return {
      x: ((event.clientX - box.left) * canvas.width) / box.width,
      y: ((event.clientY - box.top) * canvas.height) / box.height,
    };
  }

  let last = null;

  function strokeTo(p) {
    ctx.strokeStyle = tool() === "eraser" ? "#ffffff" : colour.value;
    ctx.lineWidth = Number(size.value);
    ctx.lineCap = "round";
    ctx.lineJoin = "round";
    ctx.beginPath();
    ctx.moveTo(last.x, last.y);
    ctx.lineTo(p.x, p.y);
    ctx.stroke();
    last = p;
    drawn = true;
    changed();
  }

  canvas.addEventListener("pointerdown", (event) => {
    canvas.setPointerCapture(event.pointerId);
    last = point(event);
    strokeTo({ x: last.x + 0.01, y: last.y }); // a click leaves a dot
  });
  canvas.addEventListener("pointermove", (event) => {
    if (last !== null) strokeTo(point(event));
  });
  for (const name of ["pointerup", "pointercancel"]) {
    canvas.addEventListener(name, () => {
      last = null;
    });
  }

  // --- frames ------------------------------------------------------------------------------

  function changed() {
    dirty = true;
    sendFrame();
  }

  // One frame in flight at a time; the newest canvas goes once the previous result is back.
  function sendFrame() {
    if (!dirty || inFlight !== null || socket === null || socket.readyState !== WebSocket.OPEN) return;
    dirty = false;
    seq += 1;
    const params = { prompt: prompt.value, strength: Number(strength.value) };
    socket.send(JSON.stringify({ type: "frame", seq: seq, image: canvas.toDataURL("image/png"), params: params }));
    sentAt.set(seq, performance.now());
    if (sentAt.size > 16) sentAt.delete(sentAt.keys().next().value);
    const sent = seq;
    inFlight = { seq: sent, timer: setTimeout(() => settle(sent), IN_FLIGHT_TIMEOUT_MS) };
  }

  // The frame `upTo` (or a newer one) was answered, or waited too long: the next may go.
  function settle(upTo) {
    if (inFlight === null || inFlight.seq > upTo) return;
    clearTimeout(inFlight.timer);
    inFlight = null;
    sendFrame();
  }

  function showFrame(message) {
    if (message.seq <= shownSeq) return; // older than what is shown: never shown late
    shownSeq = message.seq;
    output.src = message.image;
    const now = performance.now();
    if (sentAt.has(message.seq)) lastLatencyMs = now - sentAt.get(message.seq);
    shownAt.push(now);
    showMeter();
    const kind = /^data:image\/(png|jpeg|webp)/.exec(message.image);
    save.href = message.image;
    save.download = "potocolom-" + new Date().toISOString().replace(/[:.]/g, "-") + "." +
      (kind && kind[1] === "jpeg" ? "jpg" : kind ? kind[1] : "png");
    save.setAttribute("aria-disabled", "false");
    settle(message.seq);
  }

  // --- the socket ----------------------------------------------------------------------------

  function socketUrl() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const query = new URLSearchParams({ model_id: modelSelect.value });
    return scheme + "//" + location.host + root.dataset.socket + "?" + query.toString();
  }

  function onMessage(event) {
    let message;
    try {
      message = JSON.parse(event.data);
    } catch (err) {
      return;
    }
    if (message.type === "frame") {
      showFrame(message);
    } else if (message.type === "state" && stateText(message) !== null) {
      atLimit = false;
      if (message.state === "live") backoff.live(); // a later drop starts the backoff afresh
      setStatus(stateText(message), message.state);
    } else if (message.type === "error") {
      console.warn("the server did not take a message:", message.error);
    }
  }

  function onClose(sock, event) {
    if (sock !== socket) return; // a socket we closed ourselves (the model changed)
    socket = null;
    if (event.code === ACCOUNT_LIMIT) {
      atLimit = true;
      setStatus(limitText(), "limited");
      retryTimer = setTimeout(connect, LIMIT_RETRY_MS);
      return;
    }
    released();
    if (event.code in FINAL_CLOSES) {
      setStatus(FINAL_CLOSES[event.code], "closed");
      return;
    }
    const delay = backoff.next();
    const why = OTHER_CLOSES[event.code] || "The connection was lost (code " + event.code + ").";
    setStatus(why + " Reconnecting in " + (delay / 1000).toFixed(1) + " s…", "closed");
    retryTimer = setTimeout(connect, delay);
  }

  // This page's session ended: a tab waiting at the account's limit may start.
  function released() {
    if (tabs !== null) tabs.postMessage({ type: "released" });
  }

  function connect() {
    clearTimeout(retryTimer);
    if (socket !== null) {
      const old = socket;
      socket = null;
      old.close(1000);
      released();
    }
    if (inFlight !== null) clearTimeout(inFlight.timer);
    inFlight = null;
    if (!atLimit) setStatus("Connecting…", "");
    const sock = new WebSocket(socketUrl());
    socket = sock;
    sock.addEventListener("open", () => {
      if (drawn) dirty = true; // a new session has not seen the canvas yet
      sendFrame();
    });
    sock.addEventListener("message", onMessage);
    sock.addEventListener("close", (event) => onClose(sock, event));
  }

  // --- controls ------------------------------------------------------------------------------

  prompt.addEventListener("input", changed);
  strength.addEventListener("input", () => {
    $("strength-value").textContent = Number(strength.value).toFixed(2);
    changed();
  });
  size.addEventListener("input", () => {
    $("size-value").textContent = size.value;
  });
  $("clear").addEventListener("click", () => {
    clearCanvas();
    changed();
  });
  modelSelect.addEventListener("change", () => {
    backoff.live(); // a choice of the person, not a drop
    connect();
  });

  if (tabs !== null) {
    tabs.addEventListener("message", (event) => {
      if (atLimit && socket === null && event.data && event.data.type === "released") {
        clearTimeout(retryTimer);
        retryTimer = setTimeout(connect, RELEASED_RETRY_MS);
      }
    });
  }
  window.addEventListener("pagehide", () => {
    if (socket !== null) {
      const old = socket;
      socket = null;
      old.close(1000);
      released();
    }
  });
  setInterval(showMeter, 1000);

  clearCanvas();
  if (modelSelect.options.length > 0) connect();
})();
