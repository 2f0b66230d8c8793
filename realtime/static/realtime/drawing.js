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

  const IN_FLIGHT_TIMEOUT_MS = 3000; // send the next frame anyway if a result never comes
  const BACKOFF_FIRST_MS = 500;
  const BACKOFF_MAX_MS = 15000;
  // Close codes after which reconnecting cannot help: say why and stay closed.
  const FINAL_CLOSES = {
    4000: "bad request",
    4001: "please log in again",
    4003: "you already have two live sessions",
    4004: "no model fits",
    1000: "the session was ended",
  };
  const OTHER_CLOSES = { 4009: "a frame was too large" };

  let socket = null;
  let seq = 0; // the last frame number sent (numbers keep growing across reconnects)
  let shownSeq = -1; // the newest result shown; older ones are dropped
  let inFlight = null; // {seq, timer} of the frame awaiting its result
  let dirty = false; // the canvas or the params changed since the last frame sent
  let drawn = false; // something was drawn: a new socket gets the current canvas at once
  let retries = 0;
  let retryTimer = null;

  // --- status line -------------------------------------------------------------------------

  function setStatus(text, kind) {
    statusLine.textContent = text;
    statusLine.className = "status " + (kind || "");
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
    retries = 0; // the server answered: a later drop starts the backoff afresh
    if (message.type === "frame") {
      showFrame(message);
    } else if (message.type === "state" && message.state === "queued") {
      setStatus("queued: position " + message.position, "queued");
    } else if (message.type === "state" && message.state === "live") {
      setStatus("live on " + message.worker_id, "live");
    } else if (message.type === "state" && message.state === "idle") {
      setStatus("idle — draw to resume", "idle");
    } else if (message.type === "error") {
      console.warn("the server did not take a message:", message.error);
    }
  }

  function onClose(sock, event) {
    if (sock !== socket) return; // a socket we closed ourselves (the model changed)
    socket = null;
    if (event.code in FINAL_CLOSES) {
      setStatus("closed: " + FINAL_CLOSES[event.code], "closed");
      return;
    }
    const delay = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** retries);
    retries += 1;
    const why = OTHER_CLOSES[event.code] || "connection lost (code " + event.code + ")";
    setStatus(why + " — reconnecting in " + (delay / 1000).toFixed(1) + " s", "closed");
    retryTimer = setTimeout(connect, delay);
  }

  function connect() {
    clearTimeout(retryTimer);
    if (socket !== null) {
      const old = socket;
      socket = null;
      old.close(1000);
    }
    if (inFlight !== null) clearTimeout(inFlight.timer);
    inFlight = null;
    setStatus("connecting…", "");
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
    retries = 0;
    connect();
  });

  clearCanvas();
  if (modelSelect.options.length > 0) connect();
})();
