-- GET /v1/fine_tuning/jobs/{id} of a random job from the file named by the first argument
-- (one id a line), at most one per `delay` ms per connection (second argument; 0: as fast as
-- answers come): the polls of the mixed load.
dofile(os.getenv("WRK_LUA_DIR") .. "/common.lua")

local ids, pause = {}, 0

function init(args)
   for line in io.lines(args[1]) do
      if line ~= "" then ids[#ids + 1] = line end
   end
   pause = tonumber(args[2] or "0")
   math.randomseed(os.time() + (thread_id or 0))
end

function delay()
   return pause
end

function request()
   return wrk.format("GET", "/v1/fine_tuning/jobs/" .. ids[math.random(#ids)])
end
