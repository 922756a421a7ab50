// Talking to the server: every call carries the API key (kept in sessionStorage) when one is set.

const KEY = "tandem.apiKey";

/** The server answered 401: the key is missing or wrong. */
export class AuthRequired extends Error {}

/** A request that failed with an HTTP status and the server's OpenAI-style message. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY, key);
}

export function clearApiKey() {
  sessionStorage.removeItem(KEY);
}

/** The message of an error response (`{"error": {"message": ...}}`), else the status. */
export async function errorMessage(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && typeof body.error.message === "string") return body.error.message;
  } catch (_) {
    // not JSON: fall through
  }
  return `HTTP ${resp.status} ${resp.statusText}`.trim();
}

/** fetch() with the key; raises AuthRequired on 401 and ApiError on any other non-2xx. */
export async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const resp = await fetch(path, { ...options, headers, cache: "no-store" });
  if (resp.status === 401) throw new AuthRequired(await errorMessage(resp));
  if (!resp.ok) throw new ApiError(resp.status, await errorMessage(resp));
  return resp;
}
