"""Admission buckets in Redis: GCRA for a guaranteed and a best-effort bucket per (customer,
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

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

# redis[hiredis]: RESP packed and parsed in C (redis.asyncio packs in Python, 7x slower).
from hiredis import HiredisError, Reader
from hiredis import pack_command as _pack
from redis.exceptions import NoScriptError

from capacity.admission.bucket import Floor

log = logging.getLogger(__name__)

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
_ADMIT = (
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
_RECONCILE = (
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
_PUBLISH_LIMITS = """
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'be', ARGV[i + 1])
  redis.call('EXPIRE', KEYS[i], ttl)
end
return #KEYS
"""

# The tick's heartbeat, in Redis's own clock (what the admission script ages it with).
_TICK_HEARTBEAT = """
local t = redis.call('TIME')
redis.call('SET', KEYS[1], tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
return 1
"""
PUBLISH_LIMITS_CHUNK = 2000

# ARGV: the request's member, then the sets of requests in flight to free it from ("" for
# none): names, not KEYS, so that no empty key name is declared (an ACL user matches none).
_RELEASE = """
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


def _bucket_key(customer_id: int, model_id: int, admission_class: str) -> str:
    return f"{PREFIX}:{'g' if admission_class == GUARANTEED else 'be'}:{model_id}:{customer_id}"


def _record_key(customer_id: int, model_id: int, request_id: str) -> str:
    return f"{PREFIX}:req:{model_id}:{customer_id}:{request_id}"


def customer_scope(customer_id: int) -> str:
    return f"c:{customer_id}"


def api_key_scope(prefix: str) -> str:
    return f"k:{prefix}"


def request_limits_key(scope: str) -> str:
    return f"{PREFIX}:rl:{scope}"


def _scope_keys(scope: str | None) -> list[str]:
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


def _in_flight_keys(customer_id: int, api_key_prefix: str | None) -> list[str]:
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


def _admit_keys_and_args(
    buckets: Buckets | AsyncBuckets,
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
        _bucket_key(customer_id, model_id, GUARANTEED),
        _bucket_key(customer_id, model_id, BEST_EFFORT),
        _record_key(customer_id, model_id, request_id) if request_id else "",
        *_scope_keys(customer_scope(customer_id)),
        *_scope_keys(api_key_scope(api_key_prefix) if api_key_prefix else None),
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
    # No declared keys: their names follow the arguments (_ADMIT says why).
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


def _decision(reply: Any, cost_mu: float) -> BucketDecision:
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


class _Wire:
    """One thread's connection for Buckets' scripts, spoken to at the protocol level: the
    command packed by hiredis, written with one sendall, the reply read into a hiredis Reader.
    redis-py's Connection still makes the connection (host and port, a Unix socket or TLS, its
    timeouts, AUTH and SELECT), but its command and reply machinery cost a decision about as
    much as Redis's own work on it (bench_admission)."""

    def __init__(self, pool: redis.ConnectionPool):
        self.connection = pool.connection_class(**pool.connection_kwargs)
        self.socket: Any = None  # set on connecting, with a Reader of its own
        self.reader: Reader | None = None

    def call(self, command: tuple[Any, ...]) -> Any:
        """The command's reply; an error reply raised as redis-py raises it, and a connection
        that failed, timed out or answered what cannot be read closed and raised as a
        redis.ConnectionError or TimeoutError (the next call connects again)."""
        sock, reader = self.socket, self.reader
        if sock is None or reader is None:
            self.connection.connect()  # its handshake is answered within
            sock = self.socket = self.connection._sock
            reader = self.reader = Reader(replyError=_reply_error)
        try:
            sock.sendall(_pack(command))
            while (reply := reader.gets()) is False:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError("closed by the server")
                reader.feed(data)
        except TimeoutError:  # socket.timeout
            self.close()
            raise redis.TimeoutError("Redis did not answer within the socket timeout") from None
        except (OSError, HiredisError) as error:
            self.close()
            raise redis.ConnectionError(f"the connection to Redis failed: {error}") from error
        if isinstance(reply, redis.ResponseError):
            raise reply
        return reply

    def close(self) -> None:
        self.socket = self.reader = None
        self.connection.disconnect()


class Buckets:
    """The Redis side of admission. Raises redis.RedisError when Redis cannot be reached.

    `rate_window_seconds` is what RPM and TPM count over (60 s; a test may shorten it);
    `in_flight_ttl_seconds` bounds how long a request holds a concurrency slot whose release
    never came; the best-effort allowances are whole while the tick's heartbeat is at most
    `best_effort_fresh_seconds` old and worth nothing at `best_effort_stale_seconds`."""

    def __init__(
        self,
        client,
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
        self.client = client
        self.burst_seconds = burst_seconds
        self.idle_ttl_ms = int(idle_ttl_seconds * 1000)
        self.record_ttl_s = record_ttl_s
        self.in_flight_ttl_ms = int(in_flight_ttl_seconds * 1000)
        self.rate_window_ms = int(rate_window_seconds * 1000)
        self.best_effort_fresh_ms = int(best_effort_fresh_seconds * 1000)
        self.best_effort_stale_ms = int(best_effort_stale_seconds * 1000)
        self.unowned_reap_delay_ms = int(unowned_reap_delay_seconds * 1000)
        self._local = threading.local()
        self._admit = client.register_script(_ADMIT)
        self._reconcile = client.register_script(_RECONCILE)
        self._release = client.register_script(_RELEASE)
        self._publish_limits = client.register_script(_PUBLISH_LIMITS)
        self._tick_heartbeat = client.register_script(_TICK_HEARTBEAT)

    def _evalsha(self, script, keys: list[str], args: list):
        """EVALSHA on this thread's own connection: a decision is one round trip, and the
        pool's checkout and the client's command machinery would cost as much as Redis does."""
        wire = getattr(self._local, "wire", None)
        if wire is None:
            wire = self._local.wire = _Wire(self.client.connection_pool)
        for attempt in (1, 2):
            try:
                return wire.call(("EVALSHA", script.sha, len(keys), *keys, *args))
            except NoScriptError:
                if attempt == 2:
                    raise
                self.client.script_load(script.script)  # Redis restarted or flushed its scripts
        raise AssertionError("unreachable")

    def admit(
        self,
        *,
        customer_id: int,
        model_id: int,
        cost_mu: float,
        request_id: str | None,
        tokens: int = 0,
        api_key_prefix: str | None = None,
        shed: bool = False,
        owner: str = "",
    ) -> BucketDecision:
        """Decide a request of `cost_mu` MU and `tokens` tokens (what TPM counts) under the
        customer's MU buckets and request limits, and the key's when `api_key_prefix` names
        one: one round trip. `shed`: the model's degradation refuses this customer's
        best-effort traffic; `owner`: the gateway worker answering the request."""
        keys, args = _admit_keys_and_args(
            self, customer_id, model_id, cost_mu, request_id, tokens, api_key_prefix, shed, owner
        )
        return _decision(self._evalsha(self._admit, keys, args), cost_mu)

    def reconcile(
        self,
        *,
        customer_id: int,
        model_id: int,
        request_id: str,
        actual_mu: float,
        api_key_prefix: str | None = None,
        pipe=None,
    ):
        """Settle an admitted request's estimate against what it used (once; a request
        without a record, or settled already, changes nothing), and free its slot in flight."""
        keys = [
            _record_key(customer_id, model_id, request_id),
            _bucket_key(customer_id, model_id, GUARANTEED),
            _bucket_key(customer_id, model_id, BEST_EFFORT),
            limits_key(customer_id, model_id),
            *_in_flight_keys(customer_id, api_key_prefix),
            floor_key(customer_id, model_id),
            OPEN_REQUESTS_KEY,
        ]
        return self._reconcile(
            keys=keys,
            args=[
                repr(float(actual_mu)),
                self.idle_ttl_ms,
                request_id,
                open_member(customer_id, model_id, request_id),
            ],
            client=pipe,
        )

    def release(self, *, customer_id: int, request_id: str, api_key_prefix: str | None = None):
        """Free the concurrency slot a request holds (its end); freeing one not held is a
        no-op."""
        return self._evalsha(
            self._release, [], [request_id, *_in_flight_keys(customer_id, api_key_prefix)]
        )

    def records(self, requests: list[tuple[int, int, str]]) -> list[AdmissionRecord | None]:
        """The admission records of (customer id, model id, request id)s, in one round trip."""
        if not requests:
            return []
        raw = self.client.mget([_record_key(c, m, r) for c, m, r in requests])
        return [parse_record(value) for value in raw]

    def publish_limits(
        self,
        limits: dict[tuple[int, int], float],
        ttl_s: int,
        *,
        changed: Collection[tuple[int, int]] | None = None,
    ) -> int:
        """Write (customer, model)'s best-effort MU/min, each with a TTL, then the tick's
        heartbeat (the allowances are as fresh as it); returns how many pairs were written.

        `changed`: the pairs whose limits moved since the last publication (the tick's stored
        allowances). While a whole publication is fresh (LIMITS_FRESH_KEY), only those are
        written: tens of thousands of stable pairs rewritten every 15 s were a tenth of the
        tick. Otherwise, or without `changed`, every pair is written and the marker set again,
        so a Redis that lost its data, or a pair a failed publication missed, is whole again
        within limits_refresh_seconds.

        The chunks are pipelined on one connection, their replies read after the last is sent:
        Redis runs a chunk while the next is built and packed (tens of thousands of pairs a
        tick, whose building cost as much as Redis's writing them)."""
        whole = changed is None or not self.client.exists(LIMITS_FRESH_KEY)
        if whole:
            items = list(limits.items())
        else:
            items = [(pair, limits[pair]) for pair in changed if pair in limits]
        try:
            self._write_limits(items, ttl_s)
        except BaseException:
            # Some pairs may be unwritten: the next tick writes them all.
            with contextlib.suppress(redis.RedisError):
                self.client.delete(LIMITS_FRESH_KEY)
            raise
        if whole:
            self.client.set(LIMITS_FRESH_KEY, "1", ex=limits_refresh_seconds(ttl_s))
        self._tick_heartbeat(keys=[LIMITS_TICK_KEY])
        return len(items)

    def _write_limits(self, items: list, ttl_s: int) -> None:
        if not items:
            return
        script = self._publish_limits
        # Loaded first (idempotent), so that no chunk's EVALSHA meets a flushed script cache.
        self.client.script_load(script.script)
        pool = self.client.connection_pool
        connection = pool.get_connection()
        try:
            sent = 0
            for start in range(0, len(items), PUBLISH_LIMITS_CHUNK):
                chunk = items[start : start + PUBLISH_LIMITS_CHUNK]
                args: list = [int(ttl_s)]
                for _, best_effort in chunk:
                    args.append(repr(float(best_effort)))
                keys = [limits_key(c, m) for (c, m), _ in chunk]
                connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                sent += 1
            for _ in range(sent):
                connection.read_response()
        except BaseException:
            # Replies may be left unread: the connection is not reused.
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def publish_floors(
        self, floors: Mapping[tuple[int, int], Floor], *, pairs: Collection[tuple[int, int]]
    ) -> None:
        """Make the reservation floors of `pairs` exactly `floors` in one transaction (the
        control plane writes them with its gateway publication: capacity.publication)."""
        pipe = self.client.pipeline(transaction=True)
        queue_floors(pipe, floors, idle_ttl_ms=self.idle_ttl_ms, pairs=pairs)
        pipe.execute()

    def open_requests(self, *, decided_before_ms: float, count: int) -> list[tuple[str, float]]:
        """Open requests (decided, no usage event yet) decided before the moment, oldest first:
        (member, decided at ms)."""
        rows = self.client.zrangebyscore(
            OPEN_REQUESTS_KEY, "-inf", decided_before_ms, start=0, num=count, withscores=True
        )
        return [(m.decode() if isinstance(m, bytes) else m, float(at)) for m, at in rows]

    def close_open(self, members: Iterable[str]) -> None:
        members = list(members)
        if members:
            self.client.zrem(OPEN_REQUESTS_KEY, *members)

    def forget_limits(self, keys: list[tuple[int, int]]) -> None:
        if keys:
            self.client.delete(*(limits_key(c, m) for c, m in keys))

    def publish_request_limits(self, limits: Mapping[str, Mapping[str, int]]) -> None:
        """Make the published request limits exactly `limits`, in one transaction (the
        control plane publishes them with the gateway documents, capacity.publication)."""
        previous = self.client.smembers(REQUEST_LIMITS_INDEX)
        pipe = self.client.pipeline(transaction=True)
        queue_request_limits(pipe, limits, previous)
        pipe.execute()


Orphaned = Callable[[BucketDecision | BaseException], None] | None


ADMISSION_CONNECTION_NAME = "mu-admission"


def _as_is(reply: Any) -> Any:
    return reply


def _reply_error(message: str) -> redis.ResponseError:
    """An error reply as redis-py raises it, for the errors admission handles itself."""
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return redis.ResponseError(message)


@dataclass(slots=True)
class _Pending:
    """A command asked of AsyncBuckets' connection; `future` None: a SCRIPT LOAD sent ahead of
    a command Redis did not know the script of, whose reply only matters if it is an error."""

    command: tuple[Any, ...]
    future: asyncio.Future[Any] | None
    orphaned: Orphaned
    parse: Callable[[Any], Any] | None
    sent_at: float = 0.0
    reloaded: bool = False


class _Replies(asyncio.Protocol):
    """Redis's replies, parsed by hiredis in the socket's callback and handed over in order."""

    def __init__(self, owner: AsyncBuckets):
        self.owner = owner
        self.reader = Reader(replyError=_reply_error)

    def data_received(self, data: bytes) -> None:
        owner = self.owner
        if owner._protocol is not self:
            return  # a connection given up already
        reader = self.reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                if not owner._sent:
                    raise ValueError("a reply to nothing that was asked")
                owner._replied(reply)
                if owner._protocol is not self:
                    return
        except (ValueError, HiredisError) as error:
            # Replies can no longer be matched to their commands: the connection goes.
            reason = f"Redis's answer could not be read: {error}"
            owner._drop(lambda: redis.ConnectionError(reason))
            return
        owner._after_replies()

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._lost(self, exc)


class AsyncBuckets:
    """`Buckets.admit` for an asyncio event loop: the same script, one EVALSHA per decision, on
    one connection of its own spoken to at the protocol level (an asyncio Protocol whose
    callback parses the replies with hiredis and settles each decision's future: no task and
    no stream reader between Redis and the request).

    Decisions asked for while a round trip is under way are pipelined together in the next one
    (one write for all of them), so under load a round trip carries many decisions and never
    blocks the loop; on an idle connection a decision is written in the loop iteration it is
    asked in. Releases of concurrency slots ride the same pipeline.

    `submit` queues a decision and returns its future; `admit` awaits it. A caller cancelled
    while it waits cancels the future, not the decision (Redis takes and records it all the
    same): `orphaned`, when given, is then called with it (or with the RedisError). The future
    raises redis.RedisError when Redis does not answer within `timeout_seconds`.

    The connection is made from the client's URL as redis-py would (host and port, or a Unix
    socket path; TLS for rediss://; AUTH with its username and password; SELECT of its
    database)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        burst_seconds: float,
        idle_ttl_seconds: float,
        record_ttl_s: int,
        timeout_seconds: float,
        in_flight_ttl_seconds: float = 600.0,
        rate_window_seconds: float = RATE_WINDOW_SECONDS,
        best_effort_fresh_seconds: float = DEFAULT_BEST_EFFORT_FRESH_SECONDS,
        best_effort_stale_seconds: float = DEFAULT_BEST_EFFORT_STALE_SECONDS,
        unowned_reap_delay_seconds: float = DEFAULT_UNOWNED_REAP_DELAY_SECONDS,
    ):
        self.client = client
        self.burst_seconds = burst_seconds
        self.idle_ttl_ms = int(idle_ttl_seconds * 1000)
        self.record_ttl_s = record_ttl_s
        self.in_flight_ttl_ms = int(in_flight_ttl_seconds * 1000)
        self.rate_window_ms = int(rate_window_seconds * 1000)
        self.best_effort_fresh_ms = int(best_effort_fresh_seconds * 1000)
        self.best_effort_stale_ms = int(best_effort_stale_seconds * 1000)
        self.unowned_reap_delay_ms = int(unowned_reap_delay_seconds * 1000)
        self.timeout_seconds = timeout_seconds
        self._script = client.register_script(_ADMIT)
        self._release_script = client.register_script(_RELEASE)
        self._queue: list[_Pending] = []  # asked, not written yet
        self._sent: collections.deque[_Pending] = collections.deque()  # written, in order
        self._protocol: _Replies | None = None
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._flush_soon: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None

    def submit(
        self,
        *,
        customer_id: int,
        model_id: int,
        cost_mu: float,
        request_id: str | None,
        tokens: int = 0,
        api_key_prefix: str | None = None,
        orphaned: Orphaned = None,
        shed: bool = False,
        owner: str = "",
    ) -> asyncio.Future[BucketDecision]:
        keys, args = _admit_keys_and_args(
            self, customer_id, model_id, cost_mu, request_id, tokens, api_key_prefix, shed, owner
        )
        command = ("EVALSHA", self._script.sha, len(keys), *keys, *args)
        return self._enqueue(command, orphaned, lambda reply: _decision(reply, cost_mu))

    def release(
        self, *, customer_id: int, request_id: str, api_key_prefix: str | None = None
    ) -> asyncio.Future[Any]:
        """Free the concurrency slot a request holds (its end), in the next round trip."""
        keys = _in_flight_keys(customer_id, api_key_prefix)
        command = ("EVALSHA", self._release_script.sha, 0, request_id, *keys)
        return self._enqueue(command, None, lambda reply: reply)

    async def admit(
        self,
        *,
        customer_id: int,
        model_id: int,
        cost_mu: float,
        request_id: str | None,
        tokens: int = 0,
        api_key_prefix: str | None = None,
        shed: bool = False,
        owner: str = "",
    ) -> BucketDecision:
        return await self.submit(
            customer_id=customer_id,
            model_id=model_id,
            cost_mu=cost_mu,
            request_id=request_id,
            tokens=tokens,
            api_key_prefix=api_key_prefix,
            shed=shed,
            owner=owner,
        )

    async def close(self) -> None:
        """Once what was asked is answered (or has failed), the connection closed."""
        deadline = time.monotonic() + 2 * self.timeout_seconds + 0.1
        # Shutdown only: a short poll rather than an event every decision would have to set.
        while (self._queue or self._sent or self._connecting) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self._disconnect()

    # -- the pipeline -------------------------------------------------------------------------

    def _enqueue(
        self, command: tuple[Any, ...], orphaned: Orphaned, parse: Callable[[Any], Any]
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(_Pending(command, future, orphaned, parse))
        # Written at the end of this loop iteration, with whatever else it asks: unless a
        # round trip is under way, whose end writes them (_after_replies).
        if self._flush_soon is None and not self._sent:
            self._flush_soon = loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._flush_soon = None
        if not self._queue or self._sent or self._connecting is not None:
            return  # written when the round trip or the connection's handshake is done
        if self._transport is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return
        self._write_queued()

    def _write_queued(self) -> None:
        """What was asked meanwhile, once nothing is in flight on a connection whose handshake
        is done (decisions asked during a round trip ride the next one)."""
        ready = self._transport is not None and self._connecting is None
        if self._queue and not self._sent and ready:
            batch, self._queue = self._queue, []
            self._write(batch)

    def _write(self, batch: list[_Pending]) -> None:
        assert self._transport is not None
        now = time.monotonic()
        for pending in batch:
            pending.sent_at = now
        self._sent.extend(batch)
        self._transport.write(b"".join([_pack(p.command) for p in batch]))
        if self._timer is None:
            self._arm_timer()

    def _replied(self, reply: Any) -> None:
        pending = self._sent.popleft()
        if isinstance(reply, NoScriptError) and not pending.reloaded and pending.parse:
            # Redis restarted or flushed its scripts: loaded again, and the command asked
            # again behind it (once).
            scripts = {s.sha: s.script for s in (self._script, self._release_script)}
            script = scripts.get(pending.command[1])
            if script is not None:
                pending.reloaded = True
                self._write([_Pending(("SCRIPT", "LOAD", script), None, None, None), pending])
                return
        self._settle(pending, reply)

    def _after_replies(self) -> None:
        if not self._sent and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._write_queued()

    @staticmethod
    def _settle(pending: _Pending, reply: Any) -> None:
        if pending.future is None or pending.parse is None:
            if isinstance(reply, BaseException):
                log.warning("Redis refused the admission connection's %s: %s",
                            pending.command[0], reply)  # fmt: skip
            return
        outcome: Any
        if isinstance(reply, BaseException):
            outcome = reply
        else:
            try:
                outcome = pending.parse(reply)
            except redis.RedisError as error:  # StateLost: decided as if Redis were down
                outcome = error
            except (ValueError, TypeError, AttributeError) as error:
                outcome = redis.ResponseError(f"bad reply: {error}")
        future = pending.future
        if future.done():  # its caller was cancelled
            if pending.orphaned is not None:
                pending.orphaned(outcome)
        elif isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _fail(self, pendings: Iterable[_Pending], error: Callable[[], redis.RedisError]) -> None:
        for pending in pendings:
            self._settle(pending, error())  # an exception of its own each

    # -- the connection -----------------------------------------------------------------------

    async def _connect(self) -> None:
        """Connect, then the handshake (AUTH, SELECT, the name), answered before any decision
        is written: a decision pipelined behind a refused AUTH would run as Redis's default
        user."""
        loop = asyncio.get_running_loop()
        handshake: list[_Pending] = []
        try:
            async with asyncio.timeout(self.timeout_seconds):
                self._transport, self._protocol = await self._open()
                handshake = [
                    _Pending(command, loop.create_future(), None, _as_is)
                    for command in self._handshake()
                ]
                self._write(handshake)
                for pending in handshake:
                    assert pending.future is not None
                    await pending.future  # an error reply raises
        except (OSError, TimeoutError, redis.RedisError) as error:
            self._sent.clear()
            self._disconnect()
            for pending in handshake:  # retrieved, so that asyncio does not log them
                future = pending.future
                if future is not None and future.done() and not future.cancelled():
                    future.exception()
            queued, self._queue = self._queue, []
            if isinstance(error, redis.RedisError):
                failure = error
                self._fail(queued, lambda: type(failure)(*failure.args))
            elif isinstance(error, TimeoutError):
                self._fail(queued, self._timeout_error)
            else:
                reason = str(error)
                self._fail(queued, lambda: redis.ConnectionError(reason))
            return
        finally:
            self._connecting = None
            if self._transport is None and self._queue:
                # Whatever else ended the attempt (the task cancelled at shutdown): no caller
                # waits for ever.
                queued, self._queue = self._queue, []
                self._fail(queued, lambda: redis.ConnectionError("no connection to Redis"))
        self._write_queued()

    async def _open(self) -> tuple[asyncio.Transport, _Replies]:
        pool = self.client.connection_pool
        kwargs = pool.connection_kwargs
        loop = asyncio.get_running_loop()
        protocol = _Replies(self)
        if kwargs.get("path"):
            transport, _ = await loop.create_unix_connection(lambda: protocol, kwargs["path"])
        else:
            ssl_context = None
            if issubclass(pool.connection_class, redis.asyncio.SSLConnection):
                # redis-py's own TLS settings of the URL (ssl_cert_reqs, ssl_ca_certs, …).
                ssl_context = pool.connection_class(**kwargs).ssl_context.get()
            transport, _ = await loop.create_connection(
                lambda: protocol,
                kwargs.get("host", "localhost"),
                int(kwargs.get("port", 6379)),
                ssl=ssl_context,
            )
        return transport, protocol  # type: ignore[return-value]

    def _handshake(self) -> list[tuple[Any, ...]]:
        kwargs = self.client.connection_pool.connection_kwargs
        commands: list[tuple[Any, ...]] = []
        password, username = kwargs.get("password"), kwargs.get("username")
        if password is not None:
            commands.append(("AUTH", username, password) if username else ("AUTH", password))
        if int(kwargs.get("db") or 0):
            commands.append(("SELECT", int(kwargs["db"])))
        # Named, so that an operator finds the gateways' admission connections in CLIENT LIST.
        commands.append(("CLIENT", "SETNAME", ADMISSION_CONNECTION_NAME))
        return commands

    def _arm_timer(self) -> None:
        if self._sent:
            delay = self._sent[0].sent_at + self.timeout_seconds - time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if not self._sent:
            return
        if time.monotonic() - self._sent[0].sent_at < self.timeout_seconds:
            self._arm_timer()
            return
        # The replies still due can no longer be matched to their commands: the connection
        # goes, and what was not written yet goes on a new one.
        self._drop(self._timeout_error)

    def _timeout_error(self) -> redis.TimeoutError:
        return redis.TimeoutError(f"Redis did not answer within {self.timeout_seconds:g} s")

    def _lost(self, protocol: _Replies, exc: Exception | None) -> None:
        if protocol is not self._protocol:
            return  # dropped already
        reason = f"the connection to Redis was lost: {exc or 'closed by the server'}"
        self._drop(lambda: redis.ConnectionError(reason))

    def _drop(self, error: Callable[[], redis.RedisError]) -> None:
        sent = list(self._sent)
        self._sent.clear()
        self._disconnect()
        self._fail(sent, error)
        if self._queue and self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self._flush)

    def _disconnect(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport, self._transport, self._protocol = self._transport, None, None
        if transport is not None:
            transport.abort()
