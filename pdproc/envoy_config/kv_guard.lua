-- pdproc kv guard: an Envoy Lua filter placed right after the ext_proc filter on every route
-- that reaches a pod. Only the gateway may put KV transfer fields into a request body: vLLM's
-- kv_transfer_params and SGLang's bootstrap_host / bootstrap_port / bootstrap_room /
-- bootstrap_pair_key / disagg_prefill_dp_rank tell a decode pod where to pull KV from, so a
-- client's own would aim it at any address. pdproc refuses a client's fields itself and marks
-- every body it checked with the dynamic metadata pdproc.body_checked = true. When that mark
-- is missing (pdproc down, timed out or failed open, a request pdproc let through unchecked,
-- or a route without pdproc), this guard refuses, with a 400, any body whose top-level JSON
-- object has one of those keys, and any body it cannot verify.
--
-- Cost: when pdproc checked the body nothing is scanned or copied. Otherwise the body is
-- copied into Lua once and its top level walked with string.find jumps, never a loop per
-- byte: a plain find from quote to quote through strings (escapes cost nothing), a
-- character-class find from bracket to bracket between the strings of nested values, one
-- anchored find per token of the top-level object. Measured at 1 MiB: +0.1 ms for one long
-- prompt string, +3 ms for 8,192 chat messages (docs/envoy-releases.md).
--
-- Conservative on purpose: a top-level key containing any backslash escape is refused
-- ("kv\u005ftransfer_params" is the same key to the decode's JSON parser), and so is a body
-- that is not exactly one JSON object (it could not be verified).

local NAMESPACE = "pdproc"
local CHECKED = "body_checked"
-- Keep in step with pdproc.request_body.GATEWAY_FIELDS (a test compares them).
local GATEWAY_FIELDS = {
  kv_transfer_params = true,
  bootstrap_host = true,
  bootstrap_port = true,
  bootstrap_room = true,
  bootstrap_pair_key = true,
  disagg_prefill_dp_rank = true,
}
local ESCAPED_KEY = "escaped key"
local NOT_OBJECT = "not a JSON object"

local find, sub, byte = string.find, string.sub, string.byte

local QUOTE, BACKSLASH, LBRACE, RBRACE, LBRACKET = 34, 92, 123, 125, 91

local function checked(handle)
  local meta = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  return meta ~= nil and meta[CHECKED] == true
end

-- Index of the quote closing the JSON string whose opening quote is at i, or nil. A plain
-- find (memchr speed) jumps from quote to quote; a quote preceded by an odd number of
-- backslashes is escaped.
local function string_end(s, i)
  local pos = i + 1
  while true do
    local j = find(s, '"', pos, true)
    if j == nil then
      return nil
    end
    local k = j - 1
    while byte(s, k) == BACKSLASH do -- stops at the opening quote at the latest
      k = k - 1
    end
    if (j - 1 - k) % 2 == 0 then
      return j
    end
    pos = j + 1
  end
end

-- Index of the last character of the JSON value starting at i, or nil. Brackets must nest
-- properly (a strict parser refuses anything else, but the walk must not be fooled by it).
local function value_end(s, i)
  local c = byte(s, i)
  if c == QUOTE then
    return string_end(s, i)
  end
  if c == LBRACE or c == LBRACKET then
    local open = {}
    local depth = 0
    local pos = i
    while true do
      local j = find(s, '[%[%]{}"]', pos)
      if j == nil then
        return nil
      end
      local d = byte(s, j)
      if d == QUOTE then
        j = string_end(s, j)
        if j == nil then
          return nil
        end
      elseif d == LBRACE or d == LBRACKET then
        depth = depth + 1
        open[depth] = d
      else
        -- "}" closes "{" (125 = 123 + 2), "]" closes "[" (93 = 91 + 2)
        if depth == 0 or open[depth] + 2 ~= d then
          return nil
        end
        depth = depth - 1
        if depth == 0 then
          return j
        end
      end
      pos = j + 1
    end
  end
  -- number, true, false, null (and the NaN / Infinity some parsers accept)
  local _, e = find(s, "^[%w%.%+%-]+", i)
  return e
end

-- nil if the body is one JSON object without the key; else why it is refused.
local function refusal(s)
  local _, p = find(s, "^[ \t\r\n]*{", 1)
  if p == nil then
    return NOT_OBJECT
  end
  local pos = p + 1
  local _, e = find(s, "^[ \t\r\n]*}", pos)
  if e ~= nil then
    return find(s, "^[ \t\r\n]*$", e + 1) == nil and NOT_OBJECT or nil
  end
  while true do
    local _, q = find(s, '^[ \t\r\n]*"', pos)
    if q == nil then
      return NOT_OBJECT
    end
    local qe = string_end(s, q)
    if qe == nil then
      return NOT_OBJECT
    end
    local key = sub(s, q + 1, qe - 1)
    if GATEWAY_FIELDS[key] then
      return key
    end
    if find(key, "\\", 1, true) ~= nil then
      return ESCAPED_KEY
    end
    local _, colon = find(s, "^[ \t\r\n]*:[ \t\r\n]*", qe + 1)
    if colon == nil then
      return NOT_OBJECT
    end
    local ve = value_end(s, colon + 1)
    if ve == nil then
      return NOT_OBJECT
    end
    local _, sep = find(s, "^[ \t\r\n]*[,}]", ve + 1)
    if sep == nil then
      return NOT_OBJECT
    end
    if byte(s, sep) == RBRACE then
      return find(s, "^[ \t\r\n]*$", sep + 1) == nil and NOT_OBJECT or nil
    end
    pos = sep + 1
  end
end

local MESSAGES = {
  [ESCAPED_KEY] = "top-level keys must be written without backslash escapes "
    .. "(one could spell a field only the gateway sets)",
  [NOT_OBJECT] = "the request body must be a JSON object",
}

local function message(why)
  -- why is a gateway field's name (plain ASCII, safe in JSON) or a MESSAGES key.
  return MESSAGES[why] or (why .. " is set by the gateway, not by clients")
end

-- What the guard did, for the access log (%DYNAMIC_METADATA(pdproc_kv_guard:verdict)%):
-- "pdproc" (pdproc had checked the body when the headers arrived), "pdproc_after_body" (single-
-- message mode: checked once the body was complete), "no_body", "scanned" (no client params
-- found) or "refused".
local function verdict(handle, value)
  handle:streamInfo():dynamicMetadata():set("pdproc_kv_guard", "verdict", value)
end

local function refuse(handle, why)
  local body = '{"object":"error","message":"' .. message(why)
    .. '","type":"BadRequestError","param":"","code":400}'
  handle:respond({
    [":status"] = "400",
    ["content-type"] = "application/json",
    ["x-pdproc-error"] = "bad_request",
  }, body)
end

function envoy_on_request(handle)
  -- pdproc checked the body: its answer comes before the headers move on (two-message mode).
  if checked(handle) then
    verdict(handle, "pdproc")
    return
  end
  -- Waits for the whole body (nil: there is none). In single-message mode the headers get
  -- here before pdproc has seen the body, so the mark is looked for again afterwards.
  local body = handle:body()
  if checked(handle) then
    verdict(handle, "pdproc_after_body")
    return
  end
  local size = body and body:length() or 0
  if size == 0 then
    verdict(handle, "no_body")
    return
  end
  local why = refusal(body:getBytes(0, size))
  if why == nil then
    verdict(handle, "scanned")
  else
    verdict(handle, "refused")
    refuse(handle, why)
  end
end
