-- POST /v1/internal/jobs/{id}/ingest with each running job's own ingest token, in turn: one metrics
-- record (one SSE event) and two memory samples per post, the step rising per job, at most one post
-- per `delay` ms per connection. Arguments: a file of "job_id token" lines, the delay in ms, the first step.
dofile(os.getenv("WRK_LUA_DIR") .. "/common.lua")

local jobs, pause, turn, step = {}, 0, 0, {}

function init(args)
   for line in io.lines(args[1]) do
      local id, token = line:match("^(%S+)%s+(%S+)$")
      if id then jobs[#jobs + 1] = {id = id, token = token} end
   end
   pause = tonumber(args[2] or "100")
   local first = tonumber(args[3] or "1000")
   -- several threads: each takes its own range of steps, so none repeats another's
   for i = 1, #jobs do step[i] = first + ((thread_id or 1) - 1) * 1000000 end
end

function request()
   turn = turn % #jobs + 1
   local job = jobs[turn]
   step[turn] = step[turn] + 1
   local s, now = step[turn], os.time()
   local body = string.format(
      '{"records": [{"kind": "metrics", "attempt": 1, "time": %d, "rank": 0, "step": %d, "total_steps": 10000000, '
      .. '"loss": %.4f, "tokens_per_s": 1200.0, "trained_tokens": %d, "step_time_s": 0.4}, '
      .. '{"kind": "memory", "attempt": 1, "time": %d, "rank": 0, "step": %d, "parameters_bytes": 16777216, '
      .. '"activations_bytes": %d, "peak_bytes": 20971520}, '
      .. '{"kind": "memory", "attempt": 1, "time": %d, "rank": 1, "step": %d, "parameters_bytes": 16777216, '
      .. '"activations_bytes": %d, "peak_bytes": 20971520}]}',
      now, s, 3.0 / (1 + s % 100), 512 * s, now, s, (s % 7 + 1) * 1048576, now, s, (s % 7 + 1) * 1048576)
   return wrk.format("POST", "/v1/internal/jobs/" .. job.id .. "/ingest",
                     {["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. job.token,
                      ["Host"] = wrk.headers["Host"]}, body)
end

function delay()
   return pause
end
