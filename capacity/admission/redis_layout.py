"""The admission store's layout in Redis: its keys, the Lua scripts that decide, settle and
release in one atomic round trip each (time from Redis's `TIME`), and what their replies and
records say. Both clients speak it: capacity.admission.redis_buckets (the control plane's,
synchronous) and capacity.admission.redis_async (the gateway's, on an event loop).
model), and the customer's (and its key's) request limits, one atomic round trip per decision
(a Lua script), time from Redis's `TIME`.

GCRA keeps one number per bucket, its theoretical arrival time (TAT, ms). A bucket with rate
`r` MU/min spends `T = 60,000 / r` ms per MU and tolerates `burst_seconds` of rate ahead of
time: a request of `c` MU fits when `max(TAT, now) + c·T − burst ≤ now`, which bounds what a
bucket admits over any interval t to `r·t + burst` (+ one request: a request larger than the
whole burst is admitted when the bucket is full, and puts it in debt). The script decides
under the one rule of capacity.admission.bucket (`split`): a request takes what is left of the
guarantee and only the rest from the best-effort bucket. It records the admitted class, the
estimate and its guaranteed part under the request id, so that the request's usage event is
billed by it and settles the difference later (`reconcile`).

Request limits (requests per minute, tokens per minute, requests in flight; per customer and
per key, capacity.admission.limits) are checked in the same script before the buckets: a
request they refuse takes nothing from the buckets, and one the buckets refuse is not counted
by them. A 429 names the limit that bit (`BucketDecision.limit`).

MU limits live in Redis too, in a hash per (customer, model) that every allocation tick
rewrites and that expires when ticks stop giving it, so departed tenants leave nothing behind.
Request limits are published whole with the gateway documents and kept until a publication
removes them. Every key of state carries a TTL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import NoScriptError

from capacity.admission.bucket import Floor

GUARANTEED, BEST_EFFORT, REFUSED = "guaranteed", "best_effort", "refused"
# Recorded (never answered) for a refusal of a customer that holds a reservation.
REFUSED_GUARANTEED = "refused_guaranteed"
PREFIX = "adm"

# The one bucket rule (capacity.admission.bucket.split) in Lua, since a script cannot call
# Python: a bucket's TAT lives at its key. Kept as its own text so that the rule's property test
# (tests/capacity/admission/test_bucket_rule.py) runs these very lines with a chosen clock.
# Each line restates one of bucket.split's, in the same order of operations, so that both
# compute the same doubles from the same state.
GCRA_LUA = """
local function gcra_tat(key, now)
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now then tat = now end
  return tat
end

local function gcra_set(key, new_tat, now, ttl_ms)
  redis.call('SET', key, tostring(new_tat), 'PX', math.floor(new_tat - now + ttl_ms))
end

local function sooner(a, b)
  if a < 0 then return b end
  if b < 0 then return a end
  return math.min(a, b)
end

-- class, guaranteed MU, best-effort MU, wait ms (refused; -1: never at these rates)
local function gcra_split(g_key, be_key, g_rate, be_rate, now, cost, burst_ms, ttl_ms)
  local left, g_tat, per_mu = 0, now, 0
  local has_g = g_rate ~= nil and g_rate > 0
  if has_g then
    per_mu = 60000 / g_rate
    g_tat = gcra_tat(g_key, now)
    local whole = g_tat + cost * per_mu
    if whole - burst_ms <= now then  -- 1. it fits the guarantee
      gcra_set(g_key, whole, now, ttl_ms)
      return 'guaranteed', cost, 0, 0
    end
    left = math.max(0, (now + burst_ms - g_tat) / per_mu)
  end
  local rest = cost - left
  local be_wait = -1
  if be_rate ~= nil and be_rate > 0 then  -- 2. what is left of the guarantee, the rest best-effort
    local be_per_mu = 60000 / be_rate
    local be_tat = gcra_tat(be_key, now)
    local be_new = be_tat + rest * be_per_mu
    local allow_at = math.min(be_new - burst_ms, be_tat)
    if allow_at <= now then
      if left > 0 then gcra_set(g_key, g_tat + left * per_mu, now, ttl_ms) end
      gcra_set(be_key, be_new, now, ttl_ms)
      return 'best_effort', left, rest, 0
    end
    be_wait = allow_at - now
  end
  if has_g and g_tat <= now then  -- 3. a full guaranteed bucket takes it into debt
    gcra_set(g_key, g_tat + cost * per_mu, now, ttl_ms)
    return 'guaranteed', cost, 0, 0
  end
  local g_wait = -1  -- 4. refused
  if has_g then g_wait = math.min(g_tat + cost * per_mu - burst_ms, g_tat) - now end
  return 'refused', 0, 0, sooner(g_wait, be_wait)
end
"""

# Request limits of one scope (a customer, or one of its keys; capacity.admission.limits).
# Requests and tokens per minute count over an exact sliding window: a log of the requests
# admitted (a sorted set, score: the admission time in ms, member "<tokens>:<nonce>") beside the
# sum of its tokens, pruned of what left the window at every decision; so a limit of N admits at
# most N in ANY window of that length, never 2N across a minute's boundary as fixed buckets
# would. Requests in flight are a sorted set of request ids, scored with when each slot lapses
# (the TTL that bounds what a lost release can leak).
REQUEST_LIMITS_LUA = """
-- a scope's request limits (nil: none), and whether its budget's hard cap is on: one read
local function limits_of(lim_key)
  if lim_key == '' then return nil, false end
  local l = redis.call('HMGET', lim_key, 'rpm', 'tpm', 'concurrency', 'budget')
  local rpm, tpm, cc = tonumber(l[1]), tonumber(l[2]), tonumber(l[3])
  local capped = l[4] == '1'
  if rpm == nil and tpm == nil and cc == nil then return nil, capped end
  return {rpm = rpm, tpm = tpm, cc = cc}, capped
end

-- requests and tokens in the window (now - window, now], once older entries are dropped
local function log_prune(log_key, tok_key, cutoff)
  local gone = redis.call('ZRANGEBYSCORE', log_key, '-inf', cutoff)
  if #gone > 0 then
    local freed = 0
    for _, member in ipairs(gone) do freed = freed + tonumber(string.match(member, '^%d+')) end
    redis.call('ZREMRANGEBYSCORE', log_key, '-inf', cutoff)
    redis.call('DECRBY', tok_key, freed)
  end
  local count = redis.call('ZCARD', log_key)
  if count == 0 then
    redis.call('DEL', tok_key)
    return 0, 0
  end
  return count, tonumber(redis.call('GET', tok_key)) or 0
end

-- when enough of the log leaves the window for `need` tokens to fit
local function tpm_wait(log_key, need, now, window)
  local freed, from = 0, 0
  while true do
    local chunk = redis.call('ZRANGE', log_key, from, from + 127, 'WITHSCORES')
    if #chunk == 0 then return window end
    for j = 1, #chunk, 2 do
      freed = freed + tonumber(string.match(chunk[j], '^%d+'))
      if freed >= need then return tonumber(chunk[j + 1]) + window - now end
    end
    from = from + 128
  end
end

-- the limit of this scope that refuses the request, and its wait (-1: never); nil when none
local function scope_refusal(lim, log_key, tok_key, cc_key, now, window, tokens)
  local bit, bit_wait = nil, 0
  local function bites(name, wait)
    if bit == nil or (bit_wait >= 0 and (wait < 0 or wait > bit_wait)) then
      bit, bit_wait = name, wait
    end
  end
  if lim.cc ~= nil then
    redis.call('ZREMRANGEBYSCORE', cc_key, '-inf', now)  -- slots whose release never came
    if redis.call('ZCARD', cc_key) >= lim.cc then
      -- A slot frees when a request in flight ends, which nothing here foretells: ask again
      -- in a second, or when the first slot lapses if that is sooner.
      local first = redis.call('ZRANGE', cc_key, 0, 0, 'WITHSCORES')
      local wait = 1000
      if first[2] then wait = math.min(wait, tonumber(first[2]) - now) end
      bites('concurrency', wait)
    end
  end
  if lim.rpm ~= nil or lim.tpm ~= nil then
    local count, used = log_prune(log_key, tok_key, now - window)
    if lim.rpm ~= nil and count >= lim.rpm then
      local wait = -1
      if lim.rpm > 0 then
        local at = redis.call('ZRANGE', log_key, count - lim.rpm, count - lim.rpm, 'WITHSCORES')
        wait = tonumber(at[2]) + window - now
      end
      bites('rpm', wait)
    end
    if lim.tpm ~= nil and used + tokens > lim.tpm then
      local wait = -1
      if tokens <= lim.tpm then wait = tpm_wait(log_key, used + tokens - lim.tpm, now, window) end
      bites('tpm', wait)
    end
  end
  return bit, bit_wait
end

-- count an admitted request in the scope; 1 when it holds a slot in flight
local function scope_take(lim, log_key, tok_key, cc_key, now, window, tokens, nonce, member, cc_ttl)
  if lim.rpm ~= nil or lim.tpm ~= nil then
    redis.call('ZADD', log_key, now, tokens .. ':' .. nonce)
    redis.call('INCRBY', tok_key, tokens)
    redis.call('PEXPIRE', log_key, window)
    redis.call('PEXPIRE', tok_key, window)
  end
  if lim.cc ~= nil then
    redis.call('ZADD', cc_key, now + cc_ttl, member)
    redis.call('PEXPIRE', cc_key, cc_ttl)
    return 1
  end
  return 0
end
"""

# The two rates a decision takes from outside the buckets, each restating a function of
# capacity.admission.bucket (`floor_at`, `best_effort_now`; tests/capacity/admission/
# test_bucket_rule.py feeds both the same cases).
#
# The reservation floor of a (customer, model): MU/min guaranteed, a hash written by the
# control plane whenever a sale changes (capacity.admission.floors), never by the tick: field
# `g`, the floor now, and `s`, the steps the sold terms already fix ("<ms> <MU/min> ...", in
# time order: a reservation that starts or ends later), so a start or an expiry takes effect
# on time with no one awake to write it. nil: the customer holds no reservation.
#
# The best-effort allowance is the tick's (field `be` of the limits hash), worth its whole
# rate while the tick's heartbeat (LIMITS_TICK_KEY, written with every publication of the
# allowances) is at most `fresh_ms` old, then less and less, and nothing at `stale_ms`: fleet
# slack is a forecast that goes stale, the floor is a contract that does not.
FLOOR_LUA = """
local function floor_at(key, now)
  local f = redis.call('HMGET', key, 'g', 's')
  local g = tonumber(f[1])
  if f[2] then
    for at, mu in string.gmatch(f[2], '(%S+) (%S+)') do
      if tonumber(at) > now then break end
      g = tonumber(mu)
    end
  end
  return g
end

local function best_effort_now(lim_key, tick_key, now, fresh_ms, stale_ms)
  local be = tonumber(redis.call('HGET', lim_key, 'be'))
  if be == nil or be <= 0 then return be end
  local at = tonumber(redis.call('GET', tick_key))
  if at == nil then return 0 end
  local age = now - at
  if age <= fresh_ms then return be end
  if age >= stale_ms then return 0 end
  return be * (stale_ms - age) / (stale_ms - fresh_ms)
end
"""

# Key names (ARGV 17-32, see the script): MU limits hash, guaranteed TAT, best-effort TAT,
# request record (or "" for none), then
# per scope, the customer's and the key's (or four "" for none): request limits hash, log, log
# tokens, requests in flight; then the reservation floor, the tick's heartbeat, the index of
# open requests (or "" without a record), and the marker of floors written (FLOORS_WRITTEN_KEY)
# ARGV: cost MU, burst seconds, bucket TTL ms, record TTL s, tokens (what TPM counts), window
# ms, in-flight TTL ms, the request's member (its id, or a nonce), a log nonce, key prefix,
# shed ("1": the model's degradation refuses this customer's best-effort), the best-effort
# allowance's fresh and stale ages (ms), the request's owner (the gateway worker answering it,
# or "" for none), the open index's member, and when after the decision it is due for the
# reaper to look at (ms: 0 for an owned request, whose owner's liveness tells; the usage
# lateness window for one without an owner, whose event can come until then)
#
# The request limits are checked first and change nothing when they refuse (not even the MU
# buckets); a request the MU buckets refuse is not counted by them either.
#
# The guaranteed rate is the reservation floor (FLOOR_LUA), written when a sale changes and
# never by the tick, so a stalled tick cannot take it away. The best-effort rate is the tick's
# allowance, worth less as the tick's heartbeat ages (STALENESS_LUA).
#
# Degradation sheds in the same decision: with `shed` the customer has no best-effort bucket
# (as under a budget's hard cap), so nothing is admitted that a later step would refuse, and a
# request refused that way is recorded as the MU refusal it is (demand; a reservation holder's
# can earn a credit).
#
# The record ("<class>:<estimated MU>:<guaranteed MU of it>:<key prefix>:<owner>", then ":s"
# once settled) is what later decides the class its usage event is billed in, and how its MU
# splits between guaranteed and best-effort. It is written once: only its owner may ask again,
# and only while it was refused (anyone else is answered `duplicate`: AlreadyDecided). Its
# request joins the open index (score: the decision's time) until its usage event settles it:
# the reaper (capacity.metering.reaper) closes what no event ever settles.
ADMIT_LUA = (
    GCRA_LUA
    + REQUEST_LIMITS_LUA
    + FLOOR_LUA
    + """
-- The key names come after the 16 arguments, not as KEYS: Redis checks every key declared
-- to EVALSHA for write access (it cannot know what a script does with it), and a gateway's
-- ACL user may only read what the control plane owns (floors, limits, the tick's heartbeat;
-- capacity/publication/redis_acl.py). Each command below is checked for what it does.
local KEYS = {}
for i = 1, 16 do KEYS[i] = ARGV[16 + i] end
if redis.call('EXISTS', KEYS[16]) == 0 then
  -- No floor was ever written here: this Redis lost its data (a restart without persistence, a
  -- flush), and every reservation would read as none. Not a decision: the caller decides as
  -- if Redis were down, within its share of what is sold, until the floors are back.
  return {'unknown', '-1', '-1', '-1', '0', '', '', 0}
end
if KEYS[4] ~= '' then
  -- A request's record is written once. Only the worker that wrote it may ask again, and
  -- only while it was refused (a request held for a model that wakes asks until it is let
  -- in): anyone else (a second POST /api/v1/admission with a gateway's request id) would
  -- rewrite the class its usage event is billed in, or erase its settled mark.
  local prior = redis.call('GET', KEYS[4])
  if prior then
    local fields, from = {}, 1
    while true do
      local at = string.find(prior, ':', from, true)
      if not at then fields[#fields + 1] = string.sub(prior, from) break end
      fields[#fields + 1] = string.sub(prior, from, at - 1)
      from = at + 1
    end
    local admitted = fields[1] == 'guaranteed' or fields[1] == 'best_effort'
    local settled = string.sub(prior, -2) == ':s'
    local owner = fields[5] or ''
    if owner == 's' then owner = '' end
    if admitted or settled or owner == '' or owner ~= ARGV[14] then
      return {'duplicate', '-1', '-1', '-1', '0', '', '', 0}
    end
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local cost = tonumber(ARGV[1])
local burst_ms = tonumber(ARGV[2]) * 1000
local ttl_ms = tonumber(ARGV[3])
local tokens = tonumber(ARGV[5])
local window = tonumber(ARGV[6])
local cc_ttl = tonumber(ARGV[7])
local g = floor_at(KEYS[13], now)
local be = best_effort_now(KEYS[1], KEYS[14], now, tonumber(ARGV[12]), tonumber(ARGV[13]))
local shed = ARGV[11] == '1'
-- A customer whose budget's hard cap is on (field 'budget' of its request limits hash), or a
-- request sent with a key whose own budget's hard cap is on (the same field of the key's
-- hash), has no best-effort bucket: what the guarantee covers is admitted, nothing beyond.
-- The customer's cap is named first when both are on.
local capped = nil
local scopes = {}
for i, name in ipairs({'customer', 'api_key'}) do
  local base = 4 + (i - 1) * 4
  local lim, budget_capped = limits_of(KEYS[base + 1])
  if budget_capped and capped == nil then capped = name end
  if lim ~= nil then
    scopes[#scopes + 1] = {name, lim, KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]}
  end
end
local be_rate = be
if capped or shed then be_rate = nil end

local class, g_mu, wait, limit, scope, held = 'refused', 0, 0, '', '', 0
for _, s in ipairs(scopes) do
  local bit, bit_wait = scope_refusal(s[2], s[3], s[4], s[5], now, window, tokens)
  if bit ~= nil and (limit == '' or (wait >= 0 and (bit_wait < 0 or bit_wait > wait))) then
    limit, scope, wait = bit, s[1], bit_wait
  end
end
if limit == '' then
  local _
  class, g_mu, _, wait = gcra_split(KEYS[2], KEYS[3], g, be_rate, now, cost, burst_ms, ttl_ms)
  if class == 'refused' and capped then
    limit, scope = 'budget', capped
  elseif class == 'refused' and shed then
    limit = 'degradation'
  elseif class == 'refused' then
    limit = 'mu'
  else
    for _, s in ipairs(scopes) do
      local took = scope_take(s[2], s[3], s[4], s[5], now, window, ARGV[5], ARGV[9], ARGV[8],
                              cc_ttl)
      held = math.max(held, took)
    end
  end
end
local g_text = '0'
if class == 'guaranteed' then g_text = ARGV[1] elseif g_mu > 0 then g_text = tostring(g_mu) end
if KEYS[4] ~= '' then
  local recorded = class
  if class == 'refused' then
    -- A refusal by the MU buckets (or by degradation's shedding, which takes the best-effort
    -- bucket away) of a customer that holds a reservation is a refused *guaranteed* request:
    -- the one kind that can earn an SLA credit. A refusal by the customer's own request limits
    -- (or by its budget's hard cap) is neither guaranteed nor best-effort demand.
    if limit ~= 'mu' and limit ~= 'degradation' then recorded = 'refused_limit'
    elseif g ~= nil and g > 0 then recorded = 'refused_guaranteed' end
  end
  redis.call('SET', KEYS[4], recorded .. ':' .. ARGV[1] .. ':' .. g_text .. ':' .. ARGV[10]
             .. ':' .. ARGV[14], 'EX', tonumber(ARGV[4]))
  redis.call('ZADD', KEYS[15], now + tonumber(ARGV[16]), ARGV[15])
end
return {class, tostring(wait), tostring(g or -1), tostring(be or -1), g_text, limit, scope, held}
"""
)

# KEYS: request record, guaranteed TAT, best-effort TAT, MU limits hash, the customer's and the
# key's requests in flight (or ""), the reservation floor, the index of open requests
# ARGV: actual MU, bucket TTL ms, the request's member (its id), its open index member
# The record stays (marked settled) for the whole usage lateness window: the usage event's
# class is read from it, and a second event with the same id must not settle again. The
# request's MU splits as its record says (AdmissionRecord.split): a wholly guaranteed request
# stays guaranteed; a best-effort one keeps at most its guaranteed part guaranteed, so what it
# used beyond its estimate is charged to (and what it did not use is refunded first from) the
# best-effort bucket. Its event arrived: it leaves the index of open requests.
RECONCILE_LUA = (
    FLOOR_LUA
    + """
for i = 5, 6 do
  if KEYS[i] ~= '' then redis.call('ZREM', KEYS[i], ARGV[3]) end
end
redis.call('ZREM', KEYS[8], ARGV[4])
local record = redis.call('GET', KEYS[1])
if not record then return {'', '0'} end
if string.sub(record, -2) == ':s' then return {'', '0'} end
redis.call('SET', KEYS[1], record .. ':s', 'KEEPTTL')
local fields, from = {}, 1
while true do
  local at = string.find(record, ':', from, true)
  if not at then fields[#fields + 1] = string.sub(record, from) break end
  fields[#fields + 1] = string.sub(record, from, at - 1)
  from = at + 1
end
local class = fields[1]
if class ~= 'guaranteed' and class ~= 'best_effort' then return {class, '0'} end
local estimate = tonumber(fields[2])
local actual = tonumber(ARGV[1])
local g_estimate = tonumber(fields[3] or '')
if g_estimate == nil then
  if class == 'guaranteed' then g_estimate = estimate else g_estimate = 0 end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function adjust(key, rate, delta)
  if delta == 0 then return end
  if rate == nil or rate <= 0 then return end
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now then tat = now end
  -- A refund never lifts the bucket above full (TAT below now).
  local new_tat = math.max(now, tat + delta * 60000 / rate)
  redis.call('SET', key, tostring(new_tat), 'PX', math.floor(new_tat - now + tonumber(ARGV[2])))
end
local g_rate = floor_at(KEYS[7], now)
local be_rate = tonumber(redis.call('HGET', KEYS[4], 'be'))
if class == 'guaranteed' then
  adjust(KEYS[2], g_rate, actual - estimate)
else
  local g_actual = math.min(actual, g_estimate)
  adjust(KEYS[2], g_rate, g_actual - g_estimate)
  adjust(KEYS[3], be_rate, (actual - g_actual) - (estimate - g_estimate))
end
return {class, tostring(actual - estimate)}
"""
)

# KEYS: the customer's and the key's requests in flight (or ""); ARGV: the request's member.
# The gateway's end of a request: its slot frees at once, not when its usage event arrives.
# The tick's best-effort allowances, many (customer, model)s per call: HSET be and EXPIRE per
# key, done in the server rather than as two commands each through the client (tens of
# thousands per tick). ARGV: ttl seconds, then the best-effort MU/min per key, in the order of
# KEYS. (The guaranteed rate is the reservation floor's, never the tick's.)
PUBLISH_LIMITS_LUA = """
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'be', ARGV[i + 1])
  redis.call('EXPIRE', KEYS[i], ttl)
end
return #KEYS
"""

# The tick's heartbeat, in Redis's own clock (what the admission script ages it with).
TICK_HEARTBEAT_LUA = """
local t = redis.call('TIME')
redis.call('SET', KEYS[1], tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
return 1
"""
PUBLISH_LIMITS_CHUNK = 2000

# ARGV: the request's member, then the sets of requests in flight to free it from ("" for
# none): names, not KEYS, so that no empty key name is declared (an ACL user matches none).
RELEASE_LUA = """
for i = 2, #ARGV do
  if ARGV[i] ~= '' then redis.call('ZREM', ARGV[i], ARGV[1]) end
end
return 0
"""


@dataclass(frozen=True)
class BucketDecision:
    admission_class: str  # GUARANTEED, BEST_EFFORT (wholly or in part) or REFUSED
    retry_after_ms: float  # 0 when admitted; -1: never at the current limits
    guaranteed_mu_per_minute: float
    best_effort_mu_per_minute: float
    # Of the request's MU: the part taken from each bucket (partial spillover, bucket.split).
    guaranteed_mu: float = 0.0
    best_effort_mu: float = 0.0
    # Refused: the limit that refused it, "mu" (the buckets), a request limit ("rpm", "tpm",
    # "concurrency", of the scope in limit_scope: "customer" or "api_key") or "budget" (the
    # budget of the customer, or of the key in limit_scope "api_key", is spent and its hard cap
    # refuses best-effort); None when admitted.
    limit: str | None = None
    limit_scope: str | None = None
    # Admitted under a concurrency limit: it holds a slot until `release` (or its usage event,
    # or the slot's TTL).
    holds_slot: bool = False


# What a request limit is called: in the limits hash, in the answers, in the 429s.
RPM, TPM, CONCURRENCY = "rpm", "tpm", "concurrency"
REQUEST_LIMIT_FIELDS = (RPM, TPM, CONCURRENCY)
CUSTOMER_SCOPE, API_KEY_SCOPE = "customer", "api_key"
# The published request limits' scopes (capacity.publication writes them whole).
REQUEST_LIMITS_INDEX = f"{PREFIX}:rl:index"
RATE_WINDOW_SECONDS = 60.0  # what "per minute" means: any sliding window of this length
# The live defaults of ADMISSION_TICK_STALE_SECONDS and ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS
# (controlplane/settings.py): how old the tick's heartbeat may be before the best-effort
# allowances start to lose their worth, and when they are worth nothing.
DEFAULT_BEST_EFFORT_FRESH_SECONDS = 60.0
DEFAULT_BEST_EFFORT_STALE_SECONDS = 180.0
# The live default usage lateness window (USAGE_LATENESS_WINDOW_HOURS): until then a request
# admitted without an owner (POST /api/v1/admission's callers) may still report its event.
DEFAULT_UNOWNED_REAP_DELAY_SECONDS = 72 * 3600.0


# Present while the limits written whole by the last full publication are fresh: a tick then
# writes only the pairs that changed (Buckets.publish_limits). Gone after a Redis restart or
# flush, or after LIMITS_REFRESH_SECONDS, and the next tick writes every pair again.
LIMITS_FRESH_KEY = f"{PREFIX}:lim:fresh"


def limits_refresh_seconds(ttl_s: int) -> int:
    """How long a whole publication stands for the limits' TTL: a quarter of it, at most a
    minute, so a pair a tick skipped is rewritten long before it expires."""
    return max(1, min(60, int(ttl_s) // 4))


# The tick's heartbeat (ms, Redis's clock): how old the best-effort allowances are.
LIMITS_TICK_KEY = f"{PREFIX}:lim:tick"
# The reservation floors published, as "<model id>:<customer id>" (a whole publication deletes
# the floors no longer sold), and the marker of a whole publication within the last minute.
FLOORS_INDEX = f"{PREFIX}:floor:index"
FLOORS_FRESH_KEY = f"{PREFIX}:floor:fresh"
FLOORS_DIGEST_KEY = f"{PREFIX}:floor:digest"  # of the floors the last whole write wrote
# Set (no TTL) by every write of the floors, whole or not: its absence means this Redis lost
# its data, and admission then decides as if Redis were down (StateLost) rather than read
# every reservation as none.
FLOORS_WRITTEN_KEY = f"{PREFIX}:floor:written"
FLOORS_REFRESH_SECONDS = 60
# Requests decided and not yet settled by their usage event: a sorted set, member "<model
# id>:<customer id>:<request id>" (open_member), scored with when the reaper may look at it
# (ms: the decision's time, plus the usage lateness window for a request without an owner).
OPEN_REQUESTS_KEY = f"{PREFIX}:open"


def limits_key(customer_id: int, model_id: int) -> str:
    return f"{PREFIX}:lim:{model_id}:{customer_id}"


def floor_key(customer_id: int, model_id: int) -> str:
    return f"{PREFIX}:floor:{model_id}:{customer_id}"


def open_member(customer_id: int, model_id: int, request_id: str) -> str:
    return f"{model_id}:{customer_id}:{request_id}"


def parse_open_member(member: bytes | str) -> tuple[int, int, str] | None:
    """(customer id, model id, request id) of an open index member; None if unreadable."""
    text = member.decode() if isinstance(member, bytes) else member
    parts = text.split(":", 2)
    if (
        len(parts) != 3
        or not (parts[0] + parts[1]).isascii()
        or not parts[0].isdigit()
        or not parts[1].isdigit()
    ):
        return None
    return int(parts[1]), int(parts[0]), parts[2]


def bucket_key(customer_id: int, model_id: int, admission_class: str) -> str:
    return f"{PREFIX}:{'g' if admission_class == GUARANTEED else 'be'}:{model_id}:{customer_id}"


def record_key(customer_id: int, model_id: int, request_id: str) -> str:
    return f"{PREFIX}:req:{model_id}:{customer_id}:{request_id}"


def customer_scope(customer_id: int) -> str:
    return f"c:{customer_id}"


def api_key_scope(prefix: str) -> str:
    return f"k:{prefix}"


def request_limits_key(scope: str) -> str:
    return f"{PREFIX}:rl:{scope}"


def scope_keys(scope: str | None) -> list[str]:
    """A scope's request limits hash, log, log tokens and requests in flight."""
    if scope is None:
        return ["", "", "", ""]
    return [
        request_limits_key(scope),
        f"{PREFIX}:rlog:{scope}",
        f"{PREFIX}:rtok:{scope}",
        in_flight_key(scope),
    ]


def in_flight_key(scope: str) -> str:
    return f"{PREFIX}:rcc:{scope}"


def in_flight_keys(customer_id: int, api_key_prefix: str | None) -> list[str]:
    return [
        in_flight_key(customer_scope(customer_id)),
        in_flight_key(api_key_scope(api_key_prefix)) if api_key_prefix else "",
    ]


# What an admission record says about its request (the first part of the stored value).
# refused_limit: refused by the customer's own request limits (RPM, TPM, concurrency).
REFUSED_LIMIT = "refused_limit"
RECORD_CLASSES = frozenset({GUARANTEED, BEST_EFFORT, REFUSED_GUARANTEED, REFUSED, REFUSED_LIMIT})


@dataclass(frozen=True)
class AdmissionRecord:
    admission_class: str  # one of RECORD_CLASSES
    estimated_mu: float
    spooled: bool = False  # from the Redis-down fallback's spool, not from Redis
    # Of the estimate, the part the guaranteed bucket gave (None: by the class, all or nothing).
    guaranteed_estimate_mu: float | None = None
    api_key_prefix: str = ""  # the key whose request limits counted it ("" for none)
    # The gateway worker that answers the request ("" for none: POST /api/v1/admission's
    # callers), whose liveness tells the reaper whether its usage event may still come.
    owner: str = ""
    settled: bool = False  # its usage event arrived
    # A gateway's fallback claimed a guaranteed class for a customer without a reservation
    # (capacity.metering.ingestion): billed as best-effort, flagged.
    fallback_contradicted: bool = False

    @property
    def admitted(self) -> bool:
        return self.admission_class in (GUARANTEED, BEST_EFFORT)

    def split(self, actual_mu: float) -> tuple[float, float]:
        """(guaranteed MU, best-effort MU) of what the admitted request used, as the
        reconcile script charges them: a wholly guaranteed request stays guaranteed; one that
        spilled over keeps at most its guaranteed part guaranteed (the guarantee was used up
        when it was admitted), the rest is best-effort."""
        if self.admission_class == GUARANTEED:
            return actual_mu, 0.0
        if self.admission_class != BEST_EFFORT:
            return 0.0, 0.0
        guaranteed = min(actual_mu, self.guaranteed_estimate_mu or 0.0)
        return guaranteed, actual_mu - guaranteed


def parse_record(raw: bytes | str | None) -> AdmissionRecord | None:
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in RECORD_CLASSES:
        return None
    settled = parts[-1] == "s"
    if settled:
        parts = parts[:-1]
    try:
        # Records written before partial spillover have two fields (class, estimate), before
        # owners four.
        guaranteed = float(parts[2]) if len(parts) >= 4 else None
        prefix = parts[3] if len(parts) >= 4 else ""
        owner = parts[4] if len(parts) >= 5 else ""
        return AdmissionRecord(
            parts[0],
            float(parts[1]),
            guaranteed_estimate_mu=guaranteed,
            api_key_prefix=prefix,
            owner=owner,
            settled=settled,
        )
    except ValueError:
        return None


class DecisionParameters:
    """What a decision's arguments take from the client that asks it (both clients are one):
    the bucket's burst and idle TTL, the record's TTL, what RPM and TPM count over (60 s; a test
    may shorten it), how long a request holds a concurrency slot whose release never came, how
    old the tick's heartbeat may be before the best-effort allowances lose their worth (whole
    at `best_effort_fresh_seconds`, nothing at `best_effort_stale_seconds`), and how long a
    request without an owner may still report its event."""

    def __init__(
        self,
        *,
        burst_seconds: float,
        idle_ttl_seconds: float,
        record_ttl_s: int,
        in_flight_ttl_seconds: float = 600.0,
        rate_window_seconds: float = RATE_WINDOW_SECONDS,
        best_effort_fresh_seconds: float = DEFAULT_BEST_EFFORT_FRESH_SECONDS,
        best_effort_stale_seconds: float = DEFAULT_BEST_EFFORT_STALE_SECONDS,
        unowned_reap_delay_seconds: float = DEFAULT_UNOWNED_REAP_DELAY_SECONDS,
    ):
        self.burst_seconds = burst_seconds
        self.idle_ttl_ms = int(idle_ttl_seconds * 1000)
        self.record_ttl_s = record_ttl_s
        self.in_flight_ttl_ms = int(in_flight_ttl_seconds * 1000)
        self.rate_window_ms = int(rate_window_seconds * 1000)
        self.best_effort_fresh_ms = int(best_effort_fresh_seconds * 1000)
        self.best_effort_stale_ms = int(best_effort_stale_seconds * 1000)
        self.unowned_reap_delay_ms = int(unowned_reap_delay_seconds * 1000)


def admit_keys_and_args(
    buckets: DecisionParameters,
    customer_id: int,
    model_id: int,
    cost_mu: float,
    request_id: str | None,
    tokens: int = 0,
    api_key_prefix: str | None = None,
    shed: bool = False,
    owner: str = "",
) -> tuple[list[str], list[Any]]:
    keys = [
        limits_key(customer_id, model_id),
        bucket_key(customer_id, model_id, GUARANTEED),
        bucket_key(customer_id, model_id, BEST_EFFORT),
        record_key(customer_id, model_id, request_id) if request_id else "",
        *scope_keys(customer_scope(customer_id)),
        *scope_keys(api_key_scope(api_key_prefix) if api_key_prefix else None),
        floor_key(customer_id, model_id),
        LIMITS_TICK_KEY,
        OPEN_REQUESTS_KEY if request_id else "",
        FLOORS_WRITTEN_KEY,
    ]
    # The log's member must be unique per admission across every process on every host, so a
    # random one (a request id may be asked about twice).
    nonce = os.urandom(8).hex()
    args = [
        repr(float(cost_mu)),
        buckets.burst_seconds,
        buckets.idle_ttl_ms,
        buckets.record_ttl_s,
        max(0, int(tokens)),
        buckets.rate_window_ms,
        buckets.in_flight_ttl_ms,
        request_id or "~" + nonce,
        nonce,
        api_key_prefix or "",
        "1" if shed else "0",
        buckets.best_effort_fresh_ms,
        buckets.best_effort_stale_ms,
        owner,
        open_member(customer_id, model_id, request_id) if request_id else "",
        0 if owner.startswith(WORKER_OWNER_PREFIX) else buckets.unowned_reap_delay_ms,
    ]
    # No declared keys: their names follow the arguments (ADMIT_LUA says why).
    return [], [*args, *keys]


class StateLost(redis.RedisError):
    """Redis answers but holds no reservation floors (it lost its data): deciding there would
    refuse every reservation, so the caller decides as if Redis were down."""

    def __init__(self) -> None:
        super().__init__(
            "the admission store holds no reservation floors (it lost its data); deciding as "
            "if it were down until the control plane writes them again"
        )


# Owners of admission records: a gateway worker ("g…", its heartbeat in gw:v1:workers tells the
# reaper whether its events may still come), or a caller of POST /api/v1/admission ("k<key
# prefix>" or "u<user id>"), whose events can come until the lateness window is over.
WORKER_OWNER_PREFIX = "g"


class AlreadyDecided(redis.RedisError):
    """The request id has a decision already, which only the worker that asked for it may ask
    again, and only while it was refused: admission records are written once. (A RedisError,
    so that a gateway that met one, which only a second sender of its id can cause, decides
    without Redis rather than fails.)"""

    def __init__(self) -> None:
        super().__init__("this request id was decided already; its decision stands")


def decision_of(reply: Any, cost_mu: float) -> BucketDecision:
    admission_class, wait, guaranteed, best_effort, g_text, limit, scope, held = reply
    admission_class = admission_class.decode()
    if admission_class == "unknown":
        raise StateLost()
    if admission_class == "duplicate":
        raise AlreadyDecided()
    guaranteed_mu = best_effort_mu = 0.0
    if admission_class == GUARANTEED:
        guaranteed_mu = cost_mu
    elif admission_class == BEST_EFFORT:
        guaranteed_mu = float(g_text)
        best_effort_mu = cost_mu - guaranteed_mu
    return BucketDecision(
        admission_class=admission_class,
        retry_after_ms=float(wait),
        guaranteed_mu_per_minute=max(0.0, float(guaranteed)),
        best_effort_mu_per_minute=max(0.0, float(best_effort)),
        guaranteed_mu=guaranteed_mu,
        best_effort_mu=best_effort_mu,
        limit=limit.decode() or None,
        limit_scope=scope.decode() or None,
        holds_slot=bool(held),
    )


def queue_request_limits(
    pipe, limits: Mapping[str, Mapping[str, int]], previous: Iterable[bytes | str]
) -> None:
    """Queue on `pipe` the writes that make the published request limits exactly `limits`
    (scope -> {"rpm" | "tpm" | "concurrency" | "budget": int}): each scope's hash whole, the scopes
    published before and gone now deleted (`previous`: the index as read before). No TTL: a
    gateway goes on enforcing the last limits while the control plane is down."""
    gone = {s.decode() if isinstance(s, bytes) else s for s in previous} - set(limits)
    for scope in sorted(gone):
        pipe.delete(request_limits_key(scope))
    for scope, fields in limits.items():
        key = request_limits_key(scope)
        pipe.delete(key)
        pipe.hset(key, mapping={name: str(int(value)) for name, value in fields.items()})
    pipe.delete(REQUEST_LIMITS_INDEX)
    if limits:
        pipe.sadd(REQUEST_LIMITS_INDEX, *sorted(limits))


def queue_floors(
    pipe,
    floors: Mapping[tuple[int, int], Floor],
    *,
    idle_ttl_ms: int,
    pairs: Collection[tuple[int, int]] | None,
    previous: Iterable[bytes | str] = (),
) -> None:
    """Queue on `pipe` the writes that make the reservation floors of `pairs` ((customer id,
    model id)s; None: all of them, whole, `previous` being the index as read before) exactly
    `floors`: each floor's hash whole (`g`, and `s` when a sold term starts or ends later), kept
    for ever while a term is open, else until `idle_ttl_ms` after its last step; a pair no
    longer sold deleted."""
    members = {f"{m}:{c}": (c, m) for c, m in floors}
    if pairs is None:
        gone = {s.decode() if isinstance(s, bytes) else s for s in previous} - set(members)
        for member in sorted(gone):
            model_id, _, customer_id = member.partition(":")
            pipe.delete(f"{PREFIX}:floor:{model_id}:{customer_id}")
        pipe.delete(FLOORS_INDEX)
        pairs = list(floors)
    # Every write of floors (none included) says floors are kept here: the admission script
    # tells a Redis that lost its data by its absence.
    pipe.set(FLOORS_WRITTEN_KEY, str(int(time.time() * 1000)))
    for customer_id, model_id in pairs:
        key = floor_key(customer_id, model_id)
        member = f"{model_id}:{customer_id}"
        pipe.delete(key)
        floor = floors.get((customer_id, model_id))
        if floor is None:
            pipe.srem(FLOORS_INDEX, member)
            continue
        fields = {"g": repr(float(floor.mu_per_minute))}
        if floor.steps:
            fields["s"] = " ".join(f"{at_ms:.0f} {mu!r}" for at_ms, mu in floor.steps)
        pipe.hset(key, mapping=fields)
        ends_ms = floor.ends_ms
        if ends_ms is not None:
            pipe.pexpireat(key, int(ends_ms + idle_ttl_ms))
        pipe.sadd(FLOORS_INDEX, member)


def reply_error(message: str) -> redis.ResponseError:
    """An error reply as redis-py raises it, for the errors admission handles itself."""
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return redis.ResponseError(message)
