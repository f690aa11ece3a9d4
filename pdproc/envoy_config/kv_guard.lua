-- pdproc kv guard: an Envoy Lua filter placed right after the ext_proc filter on every route
-- that reaches a pod. Only the gateway may put KV transfer fields into a request body: vLLM's
-- kv_transfer_params and SGLang's bootstrap_host / bootstrap_port / bootstrap_room /
-- bootstrap_pair_key / disagg_prefill_dp_rank / decode_tp_size / kv_router_hint tell a pod
-- where to pull KV from (and in what shape), so a client's own would aim it at any address.
-- pdproc refuses a client's fields itself and marks every body it checked with the dynamic
-- metadata pdproc.body_checked = true. When that mark
-- is missing (pdproc down, timed out or failed open, a request pdproc let through unchecked,
-- or a route without pdproc), this guard refuses, with a 400, any body whose top-level JSON
-- object has one of those keys (or vLLM's ec_transfer_params), or whose `vllm_xargs` or
-- `sampling_params.extra_args` object has one (vLLM reads kv_transfer_params from there
-- too), and any body it cannot verify, including one nested deeper than pdproc allows or
-- with more strings and brackets than the walk's bound (MAX_FINDS).
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
  ec_transfer_params = true,
  bootstrap_host = true,
  bootstrap_port = true,
  bootstrap_room = true,
  bootstrap_pair_key = true,
  disagg_prefill_dp_rank = true,
  decode_tp_size = true,
  kv_router_hint = true,
}
-- Objects whose own keys vLLM also reads the fields from (pdproc.gateway_fields.
-- NESTED_CARRIERS): a top-level key naming the next table is walked one level down.
local CARRIERS = {
  vllm_xargs = {},
  sampling_params = { extra_args = {} },
}
local ESCAPED_KEY = "escaped key"
local NOT_OBJECT = "not a JSON object"
local TOO_DEEP = "too deep"
local TOO_MANY = "too many tokens"
-- The walk's bounds: past either the body is refused, not walked on. Nesting as pdproc's
-- (pdproc.request_body.MAX_NESTING, the body itself is level 1); the finds of one body, each
-- a jump to the next quote or bracket (about one per JSON string or container edge: a
-- 16 MiB body of 130,000 chat messages takes about 1.2 million), so that no body costs the
-- worker more than about 0.15 s (16 MiB of "[]," took 11 million finds, 0.75 s).
local MAX_NESTING = 254
local MAX_FINDS = 2097152

local find, sub, byte = string.find, string.sub, string.byte

local QUOTE, BACKSLASH, LBRACE, RBRACE, LBRACKET = 34, 92, 123, 125, 91

-- Finds left for the body being walked (set by refusal; the walk never yields, so one
-- counter per worker is enough).
local finds_left = 0

local function checked(handle)
  local meta = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  return meta ~= nil and meta[CHECKED] == true
end

-- Index of the quote closing the JSON string whose opening quote is at i, nil if there is
-- none, false past the find budget. A plain find (memchr speed) jumps from quote to quote;
-- a quote preceded by an odd number of backslashes is escaped.
local function string_end(s, i)
  local pos = i + 1
  while true do
    finds_left = finds_left - 1
    if finds_left < 0 then
      return false
    end
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

-- Index of the last character of the JSON value starting at i (at nesting level `level`),
-- or nil (malformed), or a reason to refuse (a bound). Brackets must nest properly (a strict
-- parser refuses anything else, but the walk must not be fooled by it).
local function value_end(s, i, level)
  local c = byte(s, i)
  if c == QUOTE then
    local e = string_end(s, i)
    if e == false then
      return TOO_MANY
    end
    return e
  end
  if c == LBRACE or c == LBRACKET then
    local open = {}
    local depth = 0
    local pos = i
    while true do
      finds_left = finds_left - 1
      if finds_left < 0 then
        return TOO_MANY
      end
      local j = find(s, '[%[%]{}"]', pos)
      if j == nil then
        return nil
      end
      local d = byte(s, j)
      if d == QUOTE then
        j = string_end(s, j)
        if j == false then
          return TOO_MANY
        elseif j == nil then
          return nil
        end
      elseif d == LBRACE or d == LBRACKET then
        depth = depth + 1
        if level + depth - 1 > MAX_NESTING then
          return TOO_DEEP
        end
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

-- The members of the JSON object whose "{" is at p (at nesting level `level`): nil and the
-- index of its "}" when none is a gateway field, else why it is refused. `carriers` names
-- the keys whose object values are walked the same way, one level down.
local function object_refusal(s, p, level, carriers)
  local pos = p + 1
  local _, e = find(s, "^[ \t\r\n]*}", pos)
  if e ~= nil then
    return nil, e
  end
  while true do
    local _, q = find(s, '^[ \t\r\n]*"', pos)
    if q == nil then
      return NOT_OBJECT
    end
    local qe = string_end(s, q)
    if qe == false then
      return TOO_MANY
    elseif qe == nil then
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
    local ve = value_end(s, colon + 1, level + 1)
    if type(ve) == "string" then
      return ve
    elseif ve == nil then
      return NOT_OBJECT
    end
    local inner = carriers and carriers[key]
    if inner ~= nil and byte(s, colon + 1) == LBRACE then
      local why = object_refusal(s, colon + 1, level + 1, inner)
      if why ~= nil then
        return why
      end
    end
    local _, sep = find(s, "^[ \t\r\n]*[,}]", ve + 1)
    if sep == nil then
      return NOT_OBJECT
    end
    if byte(s, sep) == RBRACE then
      return nil, sep
    end
    pos = sep + 1
  end
end

-- nil if the body is one JSON object without a gateway field; else why it is refused.
local function refusal(s)
  finds_left = MAX_FINDS
  local _, p = find(s, "^[ \t\r\n]*{", 1)
  if p == nil then
    return NOT_OBJECT
  end
  local why, close = object_refusal(s, p, 1, CARRIERS)
  if why ~= nil then
    return why
  end
  return find(s, "^[ \t\r\n]*$", close + 1) == nil and NOT_OBJECT or nil
end

local MESSAGES = {
  [ESCAPED_KEY] = "top-level keys must be written without backslash escapes "
    .. "(one could spell a field only the gateway sets)",
  [NOT_OBJECT] = "the request body must be a JSON object",
  [TOO_DEEP] = "request body is nested too deeply for the gateway to check it (more than "
    .. MAX_NESTING .. " levels)",
  [TOO_MANY] = "request body has too many JSON tokens for the gateway to check it (more "
    .. "than " .. MAX_FINDS .. " strings and brackets)",
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
