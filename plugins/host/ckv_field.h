// The C form of a named policy field as ctypes passes it (the test libraries libcriticalkv_host.so and
// libcriticalkv_cuda_test.so), and its conversion to the shared parser's FieldView.
#pragma once

#include "policy.h"

#include <cstring>
#include <string>
#include <vector>

extern "C"
{

    //! A named field as ctypes passes it; `type` is a criticalkv::FieldType value, `length` counts elements.
    struct CkvField
    {
        char const* name;
        void const* data;
        int32_t type;
        int32_t length;
    };

} // extern "C"

namespace criticalkv::capi
{

inline void writeMessage(std::string const& message, char* out, int32_t outLen)
{
    if (out != nullptr && outLen > 0)
    {
        std::strncpy(out, message.c_str(), static_cast<size_t>(outLen - 1));
        out[outLen - 1] = '\0';
    }
}

//! Parse ctypes fields with the plugin's parser; false with the error in (err, errLen).
inline bool parseFields(CkvField const* fields, int32_t count, PolicyConfig& config, char* err, int32_t errLen,
    PolicyUse use = PolicyUse::kPlugin)
{
    std::vector<FieldView> views;
    for (int32_t i = 0; i < count && fields != nullptr; ++i)
    {
        auto const type = fields[i].type >= 0 && fields[i].type <= static_cast<int32_t>(FieldType::kOther)
            ? static_cast<FieldType>(fields[i].type)
            : FieldType::kOther;
        views.push_back(FieldView{fields[i].name, fields[i].data, type, fields[i].length});
    }
    std::string error;
    if (!parsePolicyFields(views.data(), count, config, error, use))
    {
        writeMessage(error, err, errLen);
        return false;
    }
    return true;
}

} // namespace criticalkv::capi
