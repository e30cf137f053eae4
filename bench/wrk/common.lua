-- Loaded by every bench script (dofile(os.getenv("WRK_LUA_DIR") .. "/common.lua")): counts every
-- response status per thread and, at the end, prints one line `WRK_JSON {...}` that
-- bench/api_harness.py: parse_wrk reads (requests, duration, bytes, latency percentiles in
-- microseconds, statuses, socket errors). A script that needs its own setup defines on_setup(thread, n).

local threads = {}

function setup(thread)
   table.insert(threads, thread)
   thread:set("thread_id", #threads)
   if on_setup then on_setup(thread, #threads) end
end

statuses = {}

function response(status, headers, body)
   statuses[status] = (statuses[status] or 0) + 1
end

local function number(v)
   if v ~= v or v == math.huge or v == -math.huge then return "0" end  -- no requests: nan
   return string.format("%.1f", v)
end

local function object(t)
   local parts = {}
   for k, v in pairs(t) do
      parts[#parts + 1] = string.format('"%s": %s', tostring(k), number(v))
   end
   return "{" .. table.concat(parts, ", ") .. "}"
end

function done(summary, latency, requests)
   local counts = {}
   for _, thread in ipairs(threads) do
      for code, n in pairs(thread:get("statuses")) do
         counts[code] = (counts[code] or 0) + n
      end
   end
   local e = summary.errors
   local lat = {p50 = latency:percentile(50), p90 = latency:percentile(90), p99 = latency:percentile(99),
                max = latency.max, mean = latency.mean}
   io.write(string.format('WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, "latency_us": %s, '
                          .. '"statuses": %s, "errors": %s}\n',
                          summary.requests, summary.duration, summary.bytes, object(lat), object(counts),
                          object({connect = e.connect, read = e.read, write = e.write, status = e.status,
                                  timeout = e.timeout})))
end
